"""Route handlers run without a connection: a batch's requests and the answer cache's lookups go through the very
code of their routes (validation, model resolution, the answer cache, the engine call) by joining the route's handler
class to :class:`Captured` instead of a host's Tornado base."""

from __future__ import annotations

import json
from typing import Any

from tornado import httputil

from lemonkit.formats.headers import CACHE_HEADER
from lemonkit.server.handler import JSON
from lemonkit.server.openai import ModelRouteHandler
from lemonkit.server.service import SETTINGS_KEY, Service
from lemonkit.serving.caller import Caller

__all__ = ["Captured", "row_handler"]


class Captured:
    """What a route handler's code uses of Tornado's ``RequestHandler``, for a request that came from a batch's
    line instead of a connection: the answer it writes is kept here."""

    def __init__(self, service: Service, caller: Caller, path: str, body: bytes) -> None:
        self.settings = {SETTINGS_KEY: service}
        # a batch's deterministic requests use the answer cache unless a line's body says "cache": false
        headers = httputil.HTTPHeaders({"Content-Type": JSON, CACHE_HEADER: "use"})
        self.request = httputil.HTTPServerRequest(method="POST", uri=path, headers=headers, body=body)
        self._lemonkit_caller = caller
        self.status = 200
        self.headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._finished = False

    def set_status(self, status: int, reason: str | None = None) -> None:
        self.status = status

    def set_header(self, name: str, value: Any) -> None:
        self.headers[name] = str(value)

    def clear_header(self, name: str) -> None:
        self.headers.pop(name, None)

    def write(self, chunk: bytes | str | dict[str, Any]) -> None:
        if isinstance(chunk, dict):
            chunk = json.dumps(chunk)
        self._chunks.append(chunk.encode() if isinstance(chunk, str) else chunk)

    async def flush(self) -> None:
        pass

    def finish(self, chunk: bytes | str | dict[str, Any] | None = None) -> None:
        if chunk is not None:
            self.write(chunk)
        self._finished = True

    def get_query_argument(self, name: str, default: Any = None) -> Any:
        return default

    @property
    def body(self) -> bytes:
        return b"".join(self._chunks)


_classes: dict[type[ModelRouteHandler], type[Any]] = {}


def row_handler(route: type[ModelRouteHandler]) -> type[Any]:
    cls = _classes.get(route)
    if cls is None:
        cls = _classes[route] = type(route.__name__ + "Row", (route, Captured), {})
    return cls
