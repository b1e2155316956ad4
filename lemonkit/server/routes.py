"""The route table, shared by both hosts: where each spec route lives."""

from __future__ import annotations

from typing import Any

from lemonkit.server import lemonade, openai
from lemonkit.server.base import LemonkitHandler, NotFoundHandler

__all__ = ["API_PREFIXES", "API_ROUTES", "build"]

#: every versioned route is served under each of these
API_PREFIXES = ("api/v1/", "v1/", "api/v0/", "v0/")

API_ROUTES: list[tuple[str, type[LemonkitHandler]]] = [
    ("chat/completions", openai.ChatCompletionsHandler),
    ("completions", openai.CompletionsHandler),
    ("responses", openai.ResponsesHandler),
    ("embeddings", openai.EmbeddingsHandler),
    ("(?:rerank|reranking|reranker)", openai.RerankHandler),
    ("models", openai.ModelsHandler),
    ("models/(?P<model_id>[^/]+)", openai.ModelHandler),
    ("load", lemonade.LoadHandler),
    ("unload", lemonade.UnloadHandler),
    ("health", lemonade.HealthHandler),
    ("stats", lemonade.StatsHandler),
    ("system-info", lemonade.SystemInfoHandler),
]


def build(root: str, host_base: type[Any]) -> list[tuple[str, type[Any]]]:
    """Tornado rules for every route under ``root`` (ending in ``/``), each handler joined to ``host_base``.

    The last rule answers any other path under ``root`` with a JSON 404.
    """
    concrete: dict[type[LemonkitHandler], type[Any]] = {}

    def host(cls: type[LemonkitHandler]) -> type[Any]:
        if cls not in concrete:
            concrete[cls] = type(cls.__name__, (cls, host_base), {})
        return concrete[cls]

    rules = [(f"{root}{prefix}{path}/?", host(cls)) for prefix in API_PREFIXES for path, cls in API_ROUTES]
    rules.append((f"{root}live/?", host(lemonade.LiveHandler)))
    rules.append((f"{root}.*", host(NotFoundHandler)))
    return rules
