"""``GET /live`` answered before Tornado's application: the liveness probe stays cheap under load.

A request through :class:`tornado.web.Application` costs its routing (a regex per rule until one matches), a
:class:`~tornado.web.RequestHandler` with its default headers, an ETag hash and the access log call: about 150 us of
the one core the server's event loop has, which capped ``/live`` at a few thousand requests/s and, while the
loop also relays streamed tokens, made its latency grow with every connection waiting behind it. Orchestrators and
load balancers poll ``/live`` often; it must not be what slows the server down, nor slow down with it.

:class:`ProbeFastPath` sits between :class:`~tornado.httpserver.HTTPServer` and the application. A plain
``GET /live`` that the browser policy accepts (its ``Host`` is one of the server's names, and it carries no
``Origin``, so no CORS answer is owed) is answered here with the bytes the application would send. Anything else
(another path or method, a query string, an ``Origin``, a refused ``Host``, a conditional request) goes to the
application untouched, so every refusal and every other route keeps its one implementation there.

Access logs: like Tornado's, one ``tornado.access`` INFO line per request, emitted only when that logger is
enabled for INFO (``lemonkit serve --log-level info``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

from tornado import httputil, web
from tornado.log import access_log

from lemonkit.server.security import BrowserPolicy

__all__ = ["LIVE_BODY", "ProbeFastPath"]

#: the answer of ``/live``, the same bytes as :class:`lemonkit.server.lemonade.LiveHandler` writes
LIVE_BODY = json.dumps({"status": "ok"}).encode()
_PATHS = frozenset({"/live", "/live/"})
_OK = httputil.ResponseStartLine("HTTP/1.1", 200, "OK")
# Tornado's ETag of the body (RequestHandler.compute_etag), so a cache sees the same answer either way
_ETAG = f'"{hashlib.sha1(LIVE_BODY).hexdigest()}"'


class ProbeFastPath(httputil.HTTPServerConnectionDelegate):
    """Answers a plain ``GET /live`` itself and hands every other request to ``app``.

    Args:
        app: The application serving everything else (and ``/live`` when the fast path does not apply).
        policy: The server's ``Host`` rules: a request naming a foreign host goes to the application, which
            refuses it.
    """

    def __init__(self, app: web.Application, policy: BrowserPolicy) -> None:
        self.app = app
        self.policy = policy
        self._date = ("", -1)  # the Date header, formatted once per second

    def start_request(self, server_conn: object, request_conn: httputil.HTTPConnection) -> httputil.HTTPMessageDelegate:
        return _Request(self, server_conn, request_conn)

    def on_close(self, server_conn: object) -> None:
        self.app.on_close(server_conn)

    def takes(self, start_line: httputil.RequestStartLine, headers: httputil.HTTPHeaders) -> bool:
        """Whether this request is one the fast path may answer (see the module's doc)."""
        return (
            start_line.method == "GET"
            and start_line.path in _PATHS
            and "Origin" not in headers
            and "If-None-Match" not in headers
            and self.policy.accepts_host(headers.get("Host"))
        )

    def date(self) -> str:
        now = int(time.time())
        if self._date[1] != now:
            self._date = (httputil.format_timestamp(now), now)
        return self._date[0]


class _Request(httputil.HTTPMessageDelegate):
    """One request on a connection: answered here, or passed through to the application's delegate."""

    _inner: httputil.HTTPMessageDelegate | None = None

    def __init__(self, owner: ProbeFastPath, server_conn: object, request_conn: httputil.HTTPConnection) -> None:
        self.owner = owner
        self.server_conn = server_conn
        self.request_conn = request_conn
        self._start = 0.0

    def headers_received(
        self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine, headers: httputil.HTTPHeaders
    ) -> Any:
        if isinstance(start_line, httputil.RequestStartLine) and self.owner.takes(start_line, headers):
            self._start = time.perf_counter()
            return None
        self._inner = self.owner.app.start_request(self.server_conn, self.request_conn)
        return self._inner.headers_received(start_line, headers)

    def data_received(self, chunk: bytes) -> Any:
        if self._inner is not None:
            return self._inner.data_received(chunk)
        return None  # a body on GET /live means nothing; Tornado's handler ignores it too

    def finish(self) -> None:
        if self._inner is not None:
            self._inner.finish()
            return
        headers = httputil.HTTPHeaders()
        headers["Server"] = "TornadoServer"
        headers["Content-Type"] = "application/json"
        headers["Date"] = self.owner.date()
        headers["Etag"] = _ETAG
        headers["Content-Length"] = str(len(LIVE_BODY))
        self.request_conn.write_headers(_OK, headers, LIVE_BODY)
        self.request_conn.finish()
        if access_log.isEnabledFor(logging.INFO):
            context = getattr(self.request_conn, "context", None)
            ip = getattr(context, "remote_ip", None)
            access_log.info("200 GET /live (%s) %.2fms", ip, 1000.0 * (time.perf_counter() - self._start))

    def on_connection_close(self) -> None:
        if self._inner is not None:
            self._inner.on_connection_close()
