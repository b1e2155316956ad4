"""The route table, shared by both hosts: where each spec route lives."""

from __future__ import annotations

from typing import Any

from lemonkit.server import (
    anthropic,
    batches,
    caching,
    files_api,
    image_generation,
    install,
    lemonade,
    live_transcription,
    logs,
    metrics,
    ollama,
    openai,
    options,
    pulls,
    realtime,
    recipes,
    speech,
    tasks,
    transcriptions,
    upscale,
    utility,
)
from lemonkit.server.handler import API_PREFIXES, LemonkitHandler, LemonkitWebSocket, NotFoundHandler

__all__ = [
    "API_PREFIXES",
    "API_ROUTES",
    "OLLAMA_PREFIX",
    "PROBE_ROUTES",
    "ROOT_ROUTES",
    "VERSIONED_WS_ROUTES",
    "WS_ROUTES",
    "build",
]


API_ROUTES: list[tuple[str, type[LemonkitHandler]]] = [
    ("chat/completions", openai.ChatCompletionsHandler),
    ("completions", openai.CompletionsHandler),
    ("responses", openai.ResponsesHandler),
    ("responses/(?P<response_id>[^/]+)", openai.StoredResponseHandler),
    ("messages", anthropic.MessagesHandler),
    ("messages/count_tokens", anthropic.CountTokensHandler),
    ("tokenize", utility.TokenizeHandler),
    ("detokenize", utility.DetokenizeHandler),
    ("props", utility.PropsHandler),
    ("slots", utility.SlotsHandler),
    ("slots/(?P<slot_id>[0-9]+)", utility.SlotActionHandler),
    ("embeddings", openai.EmbeddingsHandler),
    ("(?:rerank|reranking|reranker)", openai.RerankHandler),
    ("audio/transcriptions", transcriptions.TranscriptionHandler),
    ("audio/transcriptions/details", transcriptions.TranscriptionDetailsHandler),
    ("audio/transcriptions/live", live_transcription.LiveTranscriptionHandler),
    ("audio/alignments", transcriptions.AlignmentHandler),
    ("batches/transcriptions", transcriptions.BatchTranscriptionHandler),  # before batches/{id}
    ("files", files_api.FilesHandler),
    ("files/(?P<file_id>[^/]+)", files_api.FileHandler),
    ("files/(?P<file_id>[^/]+)/content", files_api.FileContentHandler),
    ("cache", caching.AnswerCacheHandler),
    ("cache/lookup", caching.CacheLookupHandler),
    ("batches", batches.BatchesHandler),
    ("batches/(?P<batch_id>[^/]+)", batches.BatchHandler),
    ("batches/(?P<batch_id>[^/]+)/cancel", batches.BatchCancelHandler),
    ("audio/speech", speech.SpeechHandler),
    ("audio/voices", speech.VoicesHandler),
    ("audio/models", speech.SpeechModelsHandler),
    ("images/generations", image_generation.ImageGenerationHandler),
    ("images/edits", image_generation.ImageEditHandler),
    ("images/variations", image_generation.ImageVariationHandler),
    ("images/upscale", upscale.UpscaleHandler),
    ("tasks/run", tasks.TaskRunHandler),
    ("tasks/stream", tasks.TaskStreamHandler),
    ("tasks/batch", tasks.TaskBatchHandler),
    ("tasks/unload_models", tasks.UnloadModelsHandler),
    ("tasks/unload_all_models", tasks.UnloadAllModelsHandler),
    ("models", openai.ModelsHandler),
    ("models/(?P<model_id>[^/]+)/files", options.ModelFilesHandler),
    ("models/(?P<model_id>[^/]+)/options", options.ModelOptionsHandler),
    ("models/(?P<model_id>[^/]+)", openai.ModelHandler),
    ("load", lemonade.LoadHandler),
    ("unload", lemonade.UnloadHandler),
    ("health", lemonade.HealthHandler),
    ("stats", lemonade.StatsHandler),
    ("system-info", lemonade.SystemInfoHandler),
    ("pull", pulls.PullHandler),
    ("pull/variants", pulls.VariantsHandler),
    ("downloads", pulls.DownloadsHandler),
    ("downloads/control", pulls.DownloadsControlHandler),
    ("delete", pulls.DeleteHandler),
    ("recipes", recipes.RecipesHandler),
    ("recipes/run", recipes.RecipeRunHandler),
    ("install", install.InstallHandler),
    ("uninstall", install.UninstallHandler),
]

#: routes at the mount point itself, unversioned like ``/live``
ROOT_ROUTES: list[tuple[str, type[LemonkitHandler]]] = [("metrics", metrics.MetricsHandler)]

#: Ollama's routes (``lemonkit.server.ollama``) live under this, beside ``api/v1/``, as Ollama serves them
OLLAMA_PREFIX = "api/"

#: the versioned routes polled most (health checks), tried first
PROBE_ROUTES = [("health", lemonade.HealthHandler)]

#: WebSocket routes, unversioned like ``/live`` (the spec serves them from the root of its WebSocket port)
WS_ROUTES: list[tuple[str, type[LemonkitWebSocket]]] = [
    (logs.LOG_STREAM_PATH, logs.LogStreamHandler),
    ("realtime", realtime.RealtimeHandler),
]
#: WebSocket routes also served under each API prefix: OpenAI's SDK connects to ``{base_url}/realtime``
VERSIONED_WS_ROUTES: list[tuple[str, type[LemonkitWebSocket]]] = [("realtime", realtime.RealtimeHandler)]


def build(root: str, host_base: type[Any], ws_base: type[Any]) -> list[tuple[str, type[Any]]]:
    """Tornado rules for every route under ``root`` (ending in ``/``), each handler joined to its host's base.

    Args:
        root: The mount point.
        host_base: The host's request handler class (its authentication) for HTTP routes.
        ws_base: The host's WebSocket handler class (the same authentication, before the upgrade).

    The last rule answers any other path under ``root`` with a JSON 404.
    """
    concrete: dict[type[LemonkitHandler], type[Any]] = {}

    def host(cls: type[LemonkitHandler], base: type[Any] = host_base) -> type[Any]:
        if cls not in concrete:
            concrete[cls] = type(cls.__name__, (cls, base), {})
        return concrete[cls]

    # Tornado tries the rules in order, a regex each: the probes come first, so they cost one or a few matches
    # rather than a hundred (and no rule below overlaps them)
    rules = [(f"{root}live/?", host(lemonade.LiveHandler))]
    rules += [(f"{root}{prefix}{path}/?", host(cls)) for prefix in API_PREFIXES for path, cls in PROBE_ROUTES]
    rules += [
        (f"{root}{prefix}{path}/?", host(cls))
        for prefix in API_PREFIXES
        for path, cls in API_ROUTES
        if (path, cls) not in PROBE_ROUTES
    ]
    rules += [(f"{root}{path}/?", host(cls)) for path, cls in ROOT_ROUTES]
    rules += [(f"{root}{OLLAMA_PREFIX}{path}/?", host(cls)) for path, cls in ollama.OLLAMA_ROUTES]
    rules += [(f"{root}{path}/?", host(cls, ws_base)) for path, cls in WS_ROUTES]
    rules += [(f"{root}{p}{path}/?", host(cls, ws_base)) for p in API_PREFIXES for path, cls in VERSIONED_WS_ROUTES]
    rules.append((f"{root}.*", host(NotFoundHandler)))
    return rules
