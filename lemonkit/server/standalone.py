"""The standalone host: ``lemonkit serve`` (default ``127.0.0.1:13305``), no Jupyter needed."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from tornado import web, websocket
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from lemonkit.catalog.config import DEFAULT_PORT, Settings
from lemonkit.errors import Unauthorized
from lemonkit.server import batches, routes
from lemonkit.server.probe import ProbeFastPath
from lemonkit.server.security import ALLOW_HEADERS, POLICY_KEY, BrowserPolicy
from lemonkit.server.service import SETTINGS_KEY, Service
from lemonkit.serving import server_records
from lemonkit.serving.log_store import redact_logs

__all__ = ["StandaloneHandler", "StandaloneWebSocketHandler", "make_app", "serve"]

log = logging.getLogger("lemonkit.server")

if TYPE_CHECKING:
    _HandlerBase = web.RequestHandler
else:
    _HandlerBase = object  # joined to a Tornado handler class by each host base below


def _authorize(handler: web.RequestHandler, *, query: bool) -> None:
    """Refuse a request without the ``LEMONADE_API_KEY`` (when one is set) in its Bearer header (or
    ``X-Api-Key``, as Anthropic's clients send it) or, if ``query``, its ``api_key`` parameter."""
    key = handler.settings[SETTINGS_KEY].settings.api_key
    if not key or not getattr(handler, "auth_required", True):
        return
    scheme, _, token = handler.request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" and "X-Api-Key" in handler.request.headers:
        scheme, token = "bearer", handler.request.headers["X-Api-Key"]  # Anthropic's SDK sends its key so
    if scheme.lower() != "bearer" and query:
        scheme, token = "bearer", handler.get_query_argument("api_key", "")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        how = "'Authorization: Bearer <LEMONADE_API_KEY>'" + (" or '?api_key=<LEMONADE_API_KEY>'" if query else "")
        raise Unauthorized(f"A valid API key is required: send {how}")


class _Guard(_HandlerBase):
    """What both standalone bases check before anything else: the browser policy (``Host``, ``Origin``),
    then the key (a CORS preflight carries none: it is answered once the policy accepted its origin)."""

    #: whether the key may come as ``?api_key=`` too
    query_key = False

    def set_default_headers(self) -> None:
        # runs again on clear(), so error answers keep these too
        origin = self.request.headers.get("Origin")
        if origin is None:
            return
        self.set_header("Vary", "Origin")
        if self.settings[POLICY_KEY].origin_allowed(origin):
            self.set_header("Access-Control-Allow-Origin", origin)

    def prepare(self) -> None:
        self.settings[POLICY_KEY].check(self.request)
        headers = self.request.headers
        if self.request.method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers:
            self._answer_preflight()
            return
        _authorize(self, query=self.query_key)

    def _answer_preflight(self) -> None:
        defined = [m for m in self.SUPPORTED_METHODS if _defines(type(self), m.lower())]
        self.set_status(204)
        self.set_header("Access-Control-Allow-Methods", ", ".join([*defined, "OPTIONS"]))
        self.set_header("Access-Control-Allow-Headers", ALLOW_HEADERS)
        self.set_header("Access-Control-Max-Age", "600")
        self.finish()


def _defines(cls: type, method: str) -> bool:
    return method != "options" and getattr(cls, method, None) is not getattr(web.RequestHandler, method, None)


class StandaloneHandler(_Guard, web.RequestHandler):
    """Host base: the browser policy on every route, and a Bearer ``LEMONADE_API_KEY`` on every route but
    ``/live`` when one is set."""


class StandaloneWebSocketHandler(_Guard, websocket.WebSocketHandler):
    """Host base of the WebSocket routes: the key may also come as ``?api_key=`` (browsers cannot set a
    WebSocket's headers). Checked in ``prepare``, so a refused client gets a JSON 401 or 403 and no upgrade."""

    query_key = True

    def check_origin(self, origin: str) -> bool:
        return True  # prepare() applied the browser policy, which allows more than Tornado's same-host rule


def make_app(service: Service, policy: BrowserPolicy | None = None) -> web.Application:
    """The Tornado application serving every lemonkit route at the root.

    Args:
        service: The server's state.
        policy: Its ``Host`` and ``Origin`` rules (default: bound to loopback, lists from the environment).
    """
    rules = routes.build("/", StandaloneHandler, StandaloneWebSocketHandler)
    settings: dict[str, Any] = {
        SETTINGS_KEY: service,
        POLICY_KEY: policy or BrowserPolicy.create(["127.0.0.1"]),
        # pings find clients that vanished without closing, so their log subscriptions end
        "websocket_ping_interval": 30,
        # the JSON 404 of the last rule, also for a request target no rule can match ("GET http://x/ HTTP/1.1")
        "default_handler_class": rules[-1][1],
    }
    return web.Application(rules, **settings)


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
    allowed_hosts: str | list[str] | None = None,
    allowed_origins: str | list[str] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM, then unload every model.

    Args:
        host: Interface to listen on.
        port: TCP port (0 picks a free one).
        settings: Deployment settings (defaults from the environment).
        preload: A model to load before announcing readiness.
        ready: Called with the bound port once the server accepts requests.
        until_stdin_closes: Also stop when stdin reaches its end: an embedded server dies with its parent.
        allowed_hosts: ``Host`` names accepted besides this server's own (default: ``$LEMONKIT_ALLOWED_HOSTS``);
            see :mod:`lemonkit.server.security`.
        allowed_origins: Web page origins accepted, with CORS (default: ``$LEMONKIT_ALLOWED_ORIGINS``).

    Raises:
        ValueError: An allowed origin is malformed.
    """
    redact_logs()  # ?api_key= must not reach a log line, through any handler the CLI configured
    sockets = bind_sockets(port, address=host or None)
    addresses = [sock.getsockname()[0] for sock in sockets]
    try:
        policy = BrowserPolicy.create([host, *addresses], allowed_hosts, allowed_origins)
    except ValueError:
        for sock in sockets:
            sock.close()
        raise
    service = Service(settings)
    batches.start(service)
    # a plain GET /live is answered before the application's routing (see probe.py)
    server = HTTPServer(ProbeFastPath(make_app(service, policy), policy))
    server.add_sockets(sockets)
    bound = sockets[0].getsockname()[1]
    for warning in policy.warnings(service.settings.api_key):
        log.warning("%s", warning)
    if preload:
        await service.manager.load((await service.usable(preload)).id)
    kind = "embedded" if until_stdin_closes else "standalone"
    record = await asyncio.to_thread(
        server_records.write, server_records.local_url(host, bound), service.settings.api_key, kind
    )
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
        server_records.remove(record)
        server.stop()
        await service.close()
