"""The sidecar process: one engine, one model, an ASGI app under uvicorn.

Started by :mod:`lemonkit.manager` as ``python -m lemonkit.backends.sidecar
--socket PATH``; the :class:`~lemonkit.backends.base.LoadSpec` arrives as one
JSON line on stdin. The process prints one JSON line on stdout when it is ready
to serve (or failed to load), and exits when its stdin closes, so a dead parent
never leaves a model resident.

The socket is created here, inside the manager's 0700 run directory, and made
0600 before it listens: no other local user can reach the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lemonkit.backends import engine_class
from lemonkit.backends.base import ROUTES, Engine, LoadSpec
from lemonkit.errors import BackendError, LemonkitError

__all__ = ["create_app", "main"]

_END = object()
_PING = object()


def _error_response(exc: BaseException) -> JSONResponse:
    err = exc if isinstance(exc, LemonkitError) else BackendError(f"{type(exc).__name__}: {exc}")
    return JSONResponse(err.to_dict(), status_code=err.status)


def _sse_error(exc: BaseException) -> bytes:
    err = exc if isinstance(exc, LemonkitError) else BackendError(f"{type(exc).__name__}: {exc}")
    body = {"error": {"message": err.message, "type": "backend_error", "code": err.code, "status_code": err.status}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class _Stream:
    """Runs an engine iterator on the worker thread and hands SSE frames to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancel = threading.Event()

    def _put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def run(self, make: Any) -> None:
        try:
            chunks: Iterator[dict[str, Any]] = make(self.cancel.is_set)
            for chunk in chunks:
                if self.cancel.is_set():
                    return
                self._put(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self._put(b"data: [DONE]\n\n")
        except Exception as exc:
            self._put(exc)
        finally:
            self._put(_END)


def create_app(engine: Engine, *, ping_interval: float = 10.0) -> Starlette:
    """The ASGI app serving ``engine``: the OpenAI routes it implements, ``/health`` and ``/stats``."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")  # FIFO: requests queue fairly

    async def run_route(request: Request) -> Response:
        method_name, streams = ROUTES[request.url.path]
        try:
            body = await request.json()
        except ValueError:
            return _error_response(LemonkitError("sidecar got a non-JSON body", status=400, code="invalid_json"))
        method = getattr(engine, method_name)
        loop = asyncio.get_running_loop()
        if not (streams and body.get("stream")):
            gone = threading.Event()
            watcher = asyncio.ensure_future(_until_disconnect(request, gone))
            try:
                if streams:  # a client that leaves stops the engine at its next token here too
                    result = await loop.run_in_executor(executor, lambda: method(body, cancelled=gone.is_set))
                else:
                    result = await loop.run_in_executor(executor, method, body)
            except Exception as exc:
                return _error_response(exc)
            finally:
                watcher.cancel()
            return JSONResponse(result)

        stream = _Stream(loop)
        executor.submit(stream.run, lambda cancelled: method(body, cancelled=cancelled))
        # Hold the headers back briefly so that errors the engine finds up front keep their HTTP status.
        try:
            async with asyncio.timeout(min(ping_interval, 2.0)):
                first = await stream.queue.get()
        except TimeoutError:
            first = None
        if isinstance(first, BaseException):
            await stream.queue.get()  # _END
            return _error_response(first)
        return StreamingResponse(_frames(stream, first, ping_interval), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "pid": os.getpid(), "info": engine.info()})

    async def stats(request: Request) -> Response:
        return JSONResponse(engine.stats())

    routes = [Route(path, run_route, methods=["POST"]) for path in ROUTES]
    routes += [Route("/health", health), Route("/stats", stats)]
    return Starlette(routes=routes)


async def _until_disconnect(request: Request, gone: threading.Event) -> None:
    """Set ``gone`` when the client hangs up (the body is read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _frames(stream: _Stream, first: Any, ping_interval: float) -> AsyncIterator[bytes]:
    # One timer for the keep-alive pings, re-armed from the last delivery, rather than a timeout per token.
    loop = asyncio.get_running_loop()
    queue = stream.queue
    last = loop.time()
    timer: asyncio.TimerHandle

    def ping() -> None:
        nonlocal timer
        quiet = loop.time() - last
        if quiet >= ping_interval:
            queue.put_nowait(_PING)
            quiet = 0.0
        timer = loop.call_later(ping_interval - quiet, ping)

    timer = loop.call_later(ping_interval, ping)
    item = first
    try:
        while True:
            if item is None:
                item = await queue.get()
                last = loop.time()
            if item is _END:
                return
            if item is _PING:
                yield b": ping\n\n"
            else:
                yield _sse_error(item) if isinstance(item, BaseException) else item
            item = None
    finally:
        timer.cancel()
        stream.cancel.set()  # the client went away (or we finished): stop the engine at its next token


def _bind(path: str) -> socket.socket:
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket file is born 0600
    try:
        sock.bind(path)
    finally:
        os.umask(old_umask)
    sock.listen(128)
    return sock


def _announce(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _exit_with_parent() -> None:
    sys.stdin.buffer.read()  # returns at EOF: the manager closed our stdin or died
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="lemonkit-sidecar")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--ping-interval", type=float, default=10.0)
    args = parser.parse_args(argv)

    spec: LoadSpec = json.loads(sys.stdin.buffer.readline())
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    try:
        engine: Engine = engine_class(spec["recipe"])(spec)
    except Exception as exc:
        _announce({"error": {"message": f"{type(exc).__name__}: {exc}"}})
        sys.exit(1)

    sock = _bind(args.socket)
    app = create_app(engine, ping_interval=args.ping_interval)

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                _announce({"ready": True, "pid": os.getpid(), "info": engine.info()})

    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=1)
    Server(config).run(sockets=[sock])
    engine.close()


if __name__ == "__main__":
    main()
