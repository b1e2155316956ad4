"""The standalone host: ``lemonkit serve`` (default ``127.0.0.1:13305``), no Jupyter needed."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import sys
import threading
from typing import Any

from tornado import web, websocket

from lemonkit import records
from lemonkit.config import DEFAULT_PORT, Settings
from lemonkit.errors import Unauthorized
from lemonkit.server import routes
from lemonkit.server.service import SETTINGS_KEY, Service

__all__ = ["StandaloneHandler", "StandaloneWebSocketHandler", "make_app", "serve"]

log = logging.getLogger("lemonkit.server")


def _authorize(handler: web.RequestHandler, *, query: bool) -> None:
    """Refuse a request without the ``LEMONADE_API_KEY`` (when one is set) in its Bearer header or, if
    ``query``, its ``api_key`` parameter."""
    key = handler.settings[SETTINGS_KEY].settings.api_key
    if not key or not getattr(handler, "auth_required", True):
        return
    scheme, _, token = handler.request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" and query:
        scheme, token = "bearer", handler.get_query_argument("api_key", "")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        how = "'Authorization: Bearer <LEMONADE_API_KEY>'" + (" or '?api_key=<LEMONADE_API_KEY>'" if query else "")
        raise Unauthorized(f"A valid API key is required: send {how}")


class StandaloneHandler(web.RequestHandler):
    """Host base: a Bearer ``LEMONADE_API_KEY`` on every route but ``/live`` when one is set."""

    def prepare(self) -> None:
        _authorize(self, query=False)


class StandaloneWebSocketHandler(websocket.WebSocketHandler):
    """Host base of the WebSocket routes: the key may also come as ``?api_key=`` (browsers cannot set a
    WebSocket's headers). Checked in ``prepare``, so a refused client gets a 401 and no upgrade."""

    def prepare(self) -> None:
        _authorize(self, query=True)


def make_app(service: Service) -> web.Application:
    """The Tornado application serving every lemonkit route at the root."""
    # pings find clients that vanished without closing, so their log subscriptions end
    settings: dict[str, Any] = {SETTINGS_KEY: service, "websocket_ping_interval": 30}
    return web.Application(routes.build("/", StandaloneHandler, StandaloneWebSocketHandler), **settings)


def _wait_for_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    while sys.stdin.buffer.read(65536):
        pass
    loop.call_soon_threadsafe(stop.set)


async def serve(
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    settings: Settings | None = None,
    preload: str | None = None,
    ready: Any = None,
    until_stdin_closes: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM, then unload every model.

    Args:
        host: Interface to listen on.
        port: TCP port (0 picks a free one).
        settings: Deployment settings (defaults from the environment).
        preload: A model to load before announcing readiness.
        ready: Called with the bound port once the server accepts requests.
        until_stdin_closes: Also stop when stdin reaches its end: an embedded server dies with its parent.
    """
    service = Service(settings)
    server = make_app(service).listen(port, address=host)
    bound = next(iter(server._sockets.values())).getsockname()[1]
    if preload:
        await service.manager.load((await service.usable(preload)).id)
    kind = "embedded" if until_stdin_closes else "standalone"
    record = await asyncio.to_thread(records.write, records.local_url(host, bound), service.settings.api_key, kind)
    log.info("lemonkit serving on http://%s:%s/api/v1", host, bound)
    if ready is not None:
        ready(bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if until_stdin_closes:
        threading.Thread(target=_wait_for_eof, args=(loop, stop), daemon=True).start()
    try:
        await stop.wait()
    finally:
        records.remove(record)
        server.stop()
        await service.close()
