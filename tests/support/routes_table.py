"""Concrete request paths generated from the server's own route table, so a new route is tested by being in it."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from lemonkit.server.ollama import OLLAMA_ROUTES
from lemonkit.server.routes import API_PREFIXES, API_ROUTES, OLLAMA_PREFIX, ROOT_ROUTES, WS_ROUTES
from tests.support.tiny_models import TINY

#: a value for each path parameter the table names
SAMPLES = {
    "model_id": TINY,
    "digest": "sha256:" + "0" * 64,
    "response_id": "resp_" + "0" * 32,
    "slot_id": "0",
    "file_id": "file-" + "0" * 24,
    "batch_id": "batch_" + "0" * 24,
}
#: every HTTP method a client can send (Tornado's RequestHandler.SUPPORTED_METHODS)
METHODS = ("GET", "HEAD", "POST", "DELETE", "PATCH", "PUT", "OPTIONS")
#: paths no route serves: they must need credentials too
UNKNOWN = ("api/v1/no-such-route", "v1/models/a/b/c/d", "api/v2/models", "no-such-root", "api/v1/")

_ALTERNATIVES = re.compile(r"\(\?:([^()]*)\)")
_PARAMETER = re.compile(r"\(\?P<(\w+)>[^()]*\)")


@dataclass(frozen=True)
class Route:
    path: str  # below the mount point, no leading "/"
    handler: type

    def defines(self, method: str) -> bool:
        return hasattr(self.handler, method.lower())

    def __str__(self) -> str:
        return self.path


def expand(pattern: str) -> list[str]:
    """Every concrete path a route pattern matches with the sample parameters (one per ``(?:a|b)`` choice)."""
    filled = _PARAMETER.sub(lambda m: SAMPLES[m.group(1)], pattern)
    pieces = _ALTERNATIVES.split(filled)  # literal, choices, literal, choices, ...
    options = [[piece] if i % 2 == 0 else piece.split("|") for i, piece in enumerate(pieces)]
    paths = ["".join(choice) for choice in itertools.product(*options)]
    for path in paths:
        assert re.fullmatch(pattern, path), (pattern, path)
    return paths


def api_routes() -> list[Route]:
    """Every versioned route under every prefix."""
    return [
        Route(prefix + path, handler)
        for prefix in API_PREFIXES
        for pattern, handler in API_ROUTES
        for path in expand(pattern)
    ]


def root_routes() -> list[Route]:
    """The unversioned routes at the mount point (``metrics``)."""
    return [Route(path, handler) for pattern, handler in ROOT_ROUTES for path in expand(pattern)]


def post_routes() -> list[Route]:
    """One path per route that takes a body (``POST``), under the first prefix."""
    return [Route(API_PREFIXES[0] + expand(p)[0], h) for p, h in API_ROUTES if hasattr(h, "post")]


def ollama_routes() -> list[Route]:
    """Ollama's routes (``api/chat``, ...), beside the versioned ones."""
    return [Route(OLLAMA_PREFIX + path, handler) for pattern, handler in OLLAMA_ROUTES for path in expand(pattern)]


def ws_routes() -> list[str]:
    return [path for pattern, _ in WS_ROUTES for path in expand(pattern)]
