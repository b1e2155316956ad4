"""The sidecar process: one engine, one model, an ASGI app under uvicorn.

Started by :mod:`lemonkit.serving.sidecar_processes` as ``python -m lemonkit.backends.sidecar
--socket PATH``; the :class:`~lemonkit.backends.protocol.LoadSpec` arrives as one
JSON line on stdin. The process prints one JSON line on stdout when it is ready
to serve (or failed to load), and exits when its stdin closes, so a dead parent
never leaves a model resident.

The socket is created here, inside the manager's 0700 run directory, and made
0600 before it listens: no other local user can reach the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
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

from lemonkit.backends import engine_class, handoff
from lemonkit.backends.protocol import ROUTES, Binary, BinaryStream, Engine, LoadSpec, Upload
from lemonkit.errors import BackendError, InvalidArgument, LemonkitError, ModelNotApplicable
from lemonkit.formats import sse
from lemonkit.formats.headers import HANDOFF_HEADER

__all__ = ["create_app", "main"]

_END = object()
_PING = object()


def _error_response(exc: BaseException) -> JSONResponse:
    err = exc if isinstance(exc, LemonkitError) else BackendError(f"{type(exc).__name__}: {exc}")
    return JSONResponse(err.to_dict(), status_code=err.status)


def _sse_error(exc: BaseException) -> bytes:
    err = exc if isinstance(exc, LemonkitError) else BackendError(f"{type(exc).__name__}: {exc}")
    body = {"error": {"message": err.message, "type": "backend_error", "code": err.code, "status_code": err.status}}
    return sse.frame(body)


class _Head:
    """The first item of an answer that streams: SSE, or raw bytes of ``media_type``."""

    def __init__(self, media_type: str = "text/event-stream", headers: dict[str, str] | None = None) -> None:
        self.media_type = media_type
        self.headers = headers or {}

    @property
    def sse(self) -> bool:
        return self.media_type == "text/event-stream"


class _Value:
    """The whole answer of a call that does not stream: a JSON value or :class:`Binary`."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _Stream:
    """Runs one engine call on the worker thread and hands its answer to the loop, item by item.

    The queue receives an exception, a :class:`_Value`, or a :class:`_Head` followed by the stream's bytes;
    then ``_END``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, hand_off: bool = False) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancel = threading.Event()
        #: set when the engine call has returned and nothing more is written
        self.done = threading.Event()
        #: with ``hand_off``, an SSE stream's frames skip the queue: this thread writes them to the client itself
        self.sink = handoff.Sink(self.cancel) if hand_off else None

    def _put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def run(self, make: Any) -> None:
        try:
            result = make(self.cancel.is_set)
            if isinstance(result, (dict, list, Binary)):
                self._put(_Value(result))
            elif isinstance(result, BinaryStream):
                self._put(_Head(result.media_type, result.headers))
                for part in result.chunks:
                    if self.cancel.is_set():
                        return
                    if part:
                        self._put(part)
            else:
                self._put(_Head())
                send = self._put if self.sink is None else self.sink.write
                events: Iterator[dict[str, Any]] = result
                for chunk in events:
                    if self.cancel.is_set():
                        return
                    send(sse.frame(chunk))
                send(sse.DONE)
        except Exception as exc:
            self._put(exc)
        finally:
            self.done.set()
            self._put(_END)


def _uploads(body: dict[str, Any]) -> None:
    """Replace ``body["files"]`` (``[{"filename", "content_type", "data": base64}]``) with :class:`Upload` objects.

    Raises:
        InvalidArgument: ``files`` is not shaped so.
    """
    files = body.get("files")
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("data"), str) for f in files):
        raise InvalidArgument("'files' must be a list of {filename, content_type, data (base64)}")
    try:
        body["files"] = [
            Upload(
                filename=str(f.get("filename") or "audio"),
                content=base64.b64decode(f["data"], validate=True),
                content_type=str(f.get("content_type") or "application/octet-stream"),
            )
            for f in files
        ]
    except binascii.Error as exc:
        raise InvalidArgument(f"'files' holds data that is not base64: {exc}") from None


def _expects_sse(body: dict[str, Any]) -> bool:
    """Whether the front asked for an SSE stream, whose headers go out before the engine starts (then pings)."""
    return body.get("stream") is True and body.get("stream_format", "sse") == "sse"


def create_app(engine: Engine, *, ping_interval: float = 10.0, handoffs: handoff.Handoffs | None = None) -> Starlette:
    """The ASGI app serving ``engine``: the routes of :data:`~lemonkit.backends.protocol.ROUTES`, ``/health`` and
    ``/stats``.

    Args:
        handoffs: Where client connections arrive; with it, the app writes an SSE stream to the client itself when
            the front asks (:mod:`lemonkit.backends.handoff`).
    """
    # One thread per request the engine serves at once (its "slots": a batching engine generates that many
    # together); the manager admits no more, fairly per user, so requests never queue here. /health and /stats run
    # on the event loop and never wait for these.
    slots = int(engine.info().get("slots", 1))
    executor = ThreadPoolExecutor(max_workers=max(1, slots), thread_name_prefix="engine")

    async def run_route(request: Request) -> Response:
        route = ROUTES[request.url.path]
        try:
            body = await request.json()
        except ValueError:
            return _error_response(LemonkitError("sidecar got a non-JSON body", status=400, code="invalid_json"))
        if not isinstance(body, dict):
            return _error_response(LemonkitError("sidecar got a non-object body", status=400, code="invalid_json"))
        method = getattr(engine, route.method, None)
        if method is None:
            kind = engine.info().get("type", "this")
            return _error_response(ModelNotApplicable(f"{kind} models do not serve {request.url.path}"))

        def call(cancelled: Any) -> Any:
            if route.files:
                _uploads(body)
            return method(body, cancelled=cancelled) if route.cancellable else method(body)

        loop = asyncio.get_running_loop()
        sse = _expects_sse(body)
        stream = _Stream(loop, hand_off=sse and handoffs is not None and bool(request.headers.get(HANDOFF_HEADER)))
        executor.submit(stream.run, call)
        watcher = None if sse else asyncio.ensure_future(_until_disconnect(request, stream.cancel))
        try:
            if sse:  # hold the headers back briefly, so that errors found up front keep their HTTP status
                try:
                    async with asyncio.timeout(min(ping_interval, 2.0)):
                        first = await stream.queue.get()
                except TimeoutError:
                    first = _Head()
            else:  # a client that leaves meanwhile stops the engine at its next step
                first = await stream.queue.get()
            if isinstance(first, _Head) and not first.sse:
                after = await stream.queue.get()  # a raw stream's headers wait for its first bytes or error
                first = after if isinstance(after, BaseException) else [first, after]
        finally:
            if watcher is not None:
                watcher.cancel()
        if isinstance(first, BaseException):
            await stream.queue.get()  # _END
            return _error_response(first)
        if isinstance(first, _Value):
            await stream.queue.get()  # _END
            if isinstance(first.value, Binary):
                return Response(first.value.content, media_type=first.value.media_type, headers=first.value.headers)
            return JSONResponse(first.value)
        if isinstance(first, list):  # a raw stream, with its first bytes
            head, data = first
            return StreamingResponse(_raw(stream, data), media_type=head.media_type, headers=head.headers)
        if isinstance(first, _Head):  # SSE: the frames follow
            first = None
        if stream.sink is not None and handoffs is not None:
            token, connection = handoffs.expect()
            answer = _handed_over(stream, stream.sink, connection, ping_interval)
            return StreamingResponse(answer, media_type="application/json", headers={HANDOFF_HEADER: token})
        return StreamingResponse(_frames(stream, first, ping_interval), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "pid": os.getpid(), "info": engine.info()})

    async def stats(request: Request) -> Response:
        return JSONResponse(engine.stats())

    async def metrics(request: Request) -> Response:
        totals = getattr(engine, "metrics", None)  # engines that generate tokens keep them
        return JSONResponse(totals() if totals is not None else {})

    def read_off_the_loop(name: str) -> Any:
        """A route that reads the engine's state at once, beside requests that hold every worker thread."""

        async def route(request: Request) -> Response:
            method = getattr(engine, name, None)
            if method is None:
                kind = engine.info().get("type", "this")
                return _error_response(ModelNotApplicable(f"{kind} models do not serve /{name}"))
            return JSONResponse(method({}))

        return route

    routes = [Route(path, run_route, methods=["POST"]) for path in ROUTES]
    routes += [Route("/health", health), Route("/stats", stats), Route("/metrics", metrics)]
    routes += [Route(f"/{name}", read_off_the_loop(name)) for name in ("props", "slots")]
    return Starlette(routes=routes)


async def _until_disconnect(request: Request, gone: threading.Event) -> None:
    """Set ``gone`` when the client hangs up (the body is read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _raw(stream: _Stream, first: Any) -> AsyncIterator[bytes]:
    """A raw stream's bytes. An error after the headers aborts the body before its last chunk, so the front sees a
    broken stream rather than a short one that looks complete."""
    item = first
    try:
        while item is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
            item = await stream.queue.get()
    finally:
        stream.cancel.set()


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
            elif isinstance(item, _Head):
                pass  # the stream's head, arrived after the headers went out
            else:
                yield _sse_error(item) if isinstance(item, BaseException) else item
            item = None
    finally:
        timer.cancel()
        stream.cancel.set()  # the client went away (or we finished): stop the engine at its next token


async def _handed_over(
    stream: _Stream, sink: handoff.Sink, connection: asyncio.Future[socket.socket], ping_interval: float
) -> AsyncIterator[bytes]:
    """An SSE answer whose client connection the front hands over: the engine's thread writes the frames into it
    (:class:`~lemonkit.backends.handoff.Sink`), this watches for the client leaving, fills silences with pings and
    ends the body. Yields the front's answer, one JSON line: ``{"ended": "done" | "client" | "no connection"}``.

    The front leaving cancels this (the app's disconnect watch): the engine stops and the connection is shut.
    """
    loop = asyncio.get_running_loop()
    client: socket.socket | None = None
    try:
        try:
            async with asyncio.timeout(handoff.WAIT):
                client = await connection
        except TimeoutError:
            yield b'{"ended": "no connection"}\n'
            return
        await asyncio.to_thread(sink.attach, client)
        left = asyncio.Event()
        loop.add_reader(client.fileno(), _watch_client, client, sink, left)
        client_left = asyncio.ensure_future(left.wait())
        try:
            while True:  # the queue brings no tokens here: only the end, or a late error
                item = asyncio.ensure_future(stream.queue.get())
                done, _ = await asyncio.wait([item, client_left], timeout=ping_interval, return_when="FIRST_COMPLETED")
                if item not in done:
                    item.cancel()
                    if client_left in done:  # answered at once; the engine stops at its next step
                        break
                    await asyncio.to_thread(sink.ping, ping_interval)
                    continue
                if item.result() is _END:
                    break
                if isinstance(item.result(), BaseException):  # it failed after the headers went out
                    await asyncio.to_thread(sink.write, _sse_error(item.result()))
        finally:
            client_left.cancel()
        ended = "client" if sink.gone else "done"
        if not sink.gone:
            await asyncio.to_thread(sink.end)
        yield json.dumps({"ended": ended}).encode() + b"\n"
    finally:
        if client is not None:
            loop.remove_reader(client.fileno())
            if not stream.done.is_set():  # cut short: a write the engine's thread is blocked in returns now
                stream.cancel.set()
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)
            client.close()
        stream.cancel.set()


def _watch_client(client: socket.socket, sink: handoff.Sink, left: asyncio.Event) -> None:
    """The client's end is readable: it closed (the request was read whole; whatever else it sends is dropped)."""
    try:
        if client.recv(65536, socket.MSG_DONTWAIT):
            return
    except BlockingIOError:
        return
    except OSError:
        pass
    asyncio.get_running_loop().remove_reader(client.fileno())
    sink.left()
    left.set()


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
        error: dict[str, str | None] = {"message": f"{type(exc).__name__}: {exc}"}
        if isinstance(exc, LemonkitError):
            error["code"] = exc.code  # the manager tells a broken build from a bad model
        elif isinstance(exc, ImportError):  # the engine's library is missing or broken, not the model
            error["code"] = "backend_unavailable"
        _announce({"error": error})
        sys.exit(1)

    sock = _bind(args.socket)
    handoffs = handoff.Handoffs(_bind(handoff.path_for(args.socket)))
    app = create_app(engine, ping_interval=args.ping_interval, handoffs=handoffs)

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                self.handoffs = asyncio.ensure_future(handoffs.serve())
                _announce({"ready": True, "pid": os.getpid(), "info": engine.info()})

    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=1)
    Server(config).run(sockets=[sock])
    engine.close()


if __name__ == "__main__":
    main()
