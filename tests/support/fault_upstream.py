"""A real HTTP upstream on loopback that answers as a ``remote`` model's upstream would, or fails on purpose.

``{root}/{mode}/v1/...``: ``ok`` echoes what it got (and lists ``up-model``), ``stream`` streams three events,
``e500``/``e503`` fail, ``vllm``/``ollama``/``auth`` answer those servers' error shapes, ``close`` hangs up before
answering, ``hang`` answers only when released, ``cut`` hangs up after one streamed event, ``drip`` streams one
event and waits to be released; ``nolist``, ``cut`` and ``drip`` have no model list (404).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tornado import httpserver, netutil, web

__all__ = ["Seen", "fault_upstream"]


@dataclass
class Seen:
    """What the upstream received."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    #: ``hang`` answers, and ``drip`` ends its stream, once this is set (at the latest when the upstream stops)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    #: set when a client closed its connection while its request was being answered
    closed: asyncio.Event = field(default_factory=asyncio.Event)


class _Route(web.RequestHandler):
    def initialize(self, seen: Seen) -> None:
        self.seen = seen

    def on_connection_close(self) -> None:
        self.seen.closed.set()

    def get(self, mode: str, rest: str) -> None:
        if mode == "ok" and rest == "models":
            self.write({"object": "list", "data": [{"id": "up-model"}]})
        elif mode in ("nolist", "cut", "drip"):
            self.set_status(404)
            self.finish("not here")
        else:
            self.set_status(500)
            self.finish("no models")

    async def post(self, mode: str, rest: str) -> None:
        body = json.loads(self.request.body)
        self.seen.requests.append(
            {"mode": mode, "path": self.request.path, "body": body, "auth": self.request.headers.get("Authorization")}
        )
        if mode == "ok":
            self.write({"echo": body, "path": self.request.path})
        elif mode == "stream":
            self.set_header("Content-Type", "text/event-stream")
            for i in range(3):
                self.write(f'data: {{"n": {i}}}\n\n')
                await self.flush()
            self.write("data: [DONE]\n\n")
        elif mode == "e500":
            self.set_status(500)
            self.finish("boom: the engine crashed")
        elif mode == "e503":
            self.set_status(503)
            self.finish({"error": "loading model"})
        elif mode == "vllm":
            self.set_status(400)
            self.finish({"object": "error", "message": "bad things", "type": "BadRequestError", "code": 400})
        elif mode == "ollama":
            self.set_status(404)
            self.finish({"error": "model 'x' not found, try pulling it first"})
        elif mode == "auth":
            self.set_status(401)
            self.finish({"error": {"message": "Invalid API key", "type": "authentication_error"}})
        elif mode == "hang":
            await self.seen.release.wait()
            self.write({"late": True})
        elif mode == "close":
            self.request.connection.stream.close()  # hang up before answering anything
        elif mode == "drip":
            self.set_header("Content-Type", "text/event-stream")
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
            self.write(f"data: {json.dumps(chunk)}\n\n")
            await self.flush()
            await self.seen.release.wait()
            self.write("data: [DONE]\n\n")
        elif mode == "cut":
            self.set_header("Content-Type", "text/event-stream")
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
            self.write(f"data: {json.dumps(chunk)}\n\n")
            await self.flush()
            self.request.connection.stream.close()  # dies mid-stream


@contextlib.asynccontextmanager
async def fault_upstream() -> AsyncIterator[tuple[str, Seen]]:
    """A real HTTP upstream on loopback: ``{root}/{mode}/v1`` answers as ``mode`` says."""
    seen = Seen()
    app = web.Application([(r"/(\w+)/v1/(.*)", _Route, {"seen": seen})])
    sockets = netutil.bind_sockets(0, "127.0.0.1")
    server = httpserver.HTTPServer(app)
    server.add_sockets(sockets)
    try:
        yield f"http://127.0.0.1:{sockets[0].getsockname()[1]}", seen
    finally:
        seen.release.set()
        server.stop()
        await server.close_all_connections()
