"""The caller's answer cache (:mod:`lemonkit.serving.answer_cache`): ``GET`` and ``DELETE /v1/cache`` (what it holds,
emptying it) and ``POST /v1/cache/lookup`` (the answers it holds for many requests at once, without running any:
how ``lemonkit.map`` finds what a cell computed before). On a shared server each user sees only their own."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from lemonkit.errors import InvalidArgument, LemonkitError, MissingArgument
from lemonkit.server.batches import ENDPOINTS
from lemonkit.server.captured import row_handler
from lemonkit.server.handler import LemonkitHandler

__all__ = ["AnswerCacheHandler", "CacheLookupHandler"]

#: requests one lookup may name
MAX_LOOKUP = 50_000


class AnswerCacheHandler(LemonkitHandler):
    async def get(self) -> None:
        self.write_json(await asyncio.to_thread(self.service.answers.info, self.caller.name))

    async def delete(self) -> None:
        removed = await asyncio.to_thread(self.service.answers.clear, self.caller.name)
        self.write_json({"object": "answer_cache", "deleted": removed})


class CacheLookupHandler(LemonkitHandler):
    """``POST /v1/cache/lookup`` ``{"endpoint", "requests": [body, ...]}``: ``data`` holds, in order, each request's
    cached answer or ``null`` (not there, not deterministic, or not a valid request: running it says why)."""

    async def post(self) -> None:
        body = self.json_body()
        endpoint, requests = body.get("endpoint"), body.get("requests")
        if endpoint is None or requests is None:
            raise MissingArgument("endpoint and requests are required")
        if endpoint not in ENDPOINTS:
            raise InvalidArgument(f"endpoint: {endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        if not isinstance(requests, list) or len(requests) > MAX_LOOKUP:
            raise InvalidArgument(f"requests: a list of at most {MAX_LOOKUP} request bodies")
        route = row_handler(ENDPOINTS[endpoint])
        answers: list[Any] = []
        for request in requests:
            answer = None
            if isinstance(request, dict) and not request.get("stream"):
                handler = route(self.service, self.caller, endpoint, json.dumps(request).encode())
                try:
                    answer = await handler.cached(dict(request))
                except LemonkitError:
                    answer = None
            answers.append(answer)
        hits = sum(a is not None for a in answers)
        self.write_json({"object": "list", "data": answers, "hits": hits})
