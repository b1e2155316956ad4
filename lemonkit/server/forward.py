"""Forwarding: a single-user Jupyter server whose ``lemonkit/`` routes all go to the JupyterHub's lemonkit service.

With ``c.LemonkitExtension.forward_to_hub = True`` (or ``LEMONKIT_FORWARD_TO_HUB=1``) the extension loads no models
of its own: every request its user sends to ``{base_url}lemonkit/...`` (the widgets', ``lemonkit.chat()``'s through
this server, an OpenAI client's) is sent on to the hub's service with this server's hub token, so the service
sees this user. Answers pass through as they arrive (status, headers, each chunk flushed at once); a client that
hangs up closes the upstream request; the WebSocket routes are bridged message by message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast
from urllib.parse import quote

import httpx
from tornado import httpclient, websocket

from lemonkit.errors import HubServiceError, LemonkitError
from lemonkit.server.handler import LemonkitHandler, LemonkitWebSocket, allow_unauthenticated, error_event
from lemonkit.server.routes import API_PREFIXES, VERSIONED_WS_ROUTES, WS_ROUTES
from lemonkit.serving import hub_discovery

__all__ = ["UPSTREAM_KEY", "Upstream", "build"]

UPSTREAM_KEY = "lemonkit_upstream"
#: connection-level headers (RFC 9110 7.6.1) never pass a proxy; the rest pass unchanged
_HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding")
) | {"upgrade", "host", "content-length"}
#: this server's own credentials and cookies are for it alone, never for the service; the page's origin was this
#: server's to judge (Jupyter did), and the service would see it as foreign to its own host
_PRIVATE = frozenset(("authorization", "cookie", "x-xsrftoken", "x-csrftoken", "set-cookie", "origin", "referer"))
_TIMEOUT = httpx.Timeout(60.0, read=None)  # generations may be silent for long
#: Tornado hands a route its path decoded: these stay as they are when it is encoded again
_PATH_SAFE = "/:@!$&'()*+,;=-._~"


class Upstream:
    """The hub's service this server forwards to, found on first use (off the event loop) and kept.

    Args:
        hub: The hub and the service's name (``required``: a missing service is an error, never a local fallback).
    """

    def __init__(self, hub: hub_discovery.HubEnvironment) -> None:
        self.hub = hub
        self.client = httpx.AsyncClient(timeout=_TIMEOUT)
        self._service: hub_discovery.HubService | None = None
        self._lock = asyncio.Lock()

    async def service(self) -> hub_discovery.HubService:
        """The service (asked of the hub once).

        Raises:
            HubServiceError: The hub has no such service for this user, or it does not answer.
        """
        async with self._lock:
            if self._service is None:
                found = await asyncio.to_thread(hub_discovery.find, self.hub)
                if found is None:  # only when not required; the extension always requires it
                    raise HubServiceError(f"The JupyterHub has no lemonkit service {self.hub.service!r}")
                self._service = found
            return self._service

    async def aclose(self) -> None:
        await self.client.aclose()


def _outgoing(headers: Any, service: hub_discovery.HubService) -> dict[str, str]:
    kept = [(k, v) for k, v in headers.get_all() if k.lower() not in _HOP_BY_HOP | _PRIVATE]
    return {**dict(kept), **service.headers}


class ForwardHandler(LemonkitHandler):
    """Any HTTP route under ``lemonkit/``: sent on to the service, the answer streamed back."""

    @property
    def upstream(self) -> Upstream:
        upstream: Upstream = self.settings[UPSTREAM_KEY]
        return upstream

    async def _forward(self, path: str) -> None:
        service = await self.upstream.service()
        query = f"?{self.request.query}" if self.request.query else ""
        request = self.upstream.client.build_request(
            self.request.method or "GET",
            f"{service.root}/{quote(path, safe=_PATH_SAFE)}{query}",
            content=self.request.body or None,
            headers=_outgoing(self.request.headers, service),
        )
        response: httpx.Response | None = None

        async def send() -> None:
            nonlocal response
            response = await self.upstream.client.send(request, stream=True)

        try:
            if not await self.unless_gone(send()):
                return
        except httpx.TransportError as exc:
            raise HubServiceError(
                f"The JupyterHub's lemonkit service at {service.root} does not answer ({exc})"
            ) from None
        assert response is not None
        try:
            self._start(response)
            await self.pump(self._chunks(response, service))
        finally:
            await response.aclose()

    def _start(self, response: httpx.Response) -> None:
        self.set_status(response.status_code, response.reason_phrase or None)
        seen: set[str] = set()
        for name, value in response.headers.multi_items():
            if name.lower() in _HOP_BY_HOP | _PRIVATE:
                continue
            if name.lower() in seen:
                self.add_header(name, value)
            else:  # replaces Jupyter's default (its Content-Type) with the service's
                seen.add(name.lower())
                self.set_header(name, value)
        self._sse_open = True  # from here on a failure can only end the body, never replace it with an error

    async def _chunks(self, response: httpx.Response, service: hub_discovery.HubService) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                yield b"\n\n" + error_event(
                    HubServiceError(f"The JupyterHub's lemonkit service at {service.root} stopped mid-answer ({exc})")
                )
            else:
                cast(Any, self.request.connection).close()  # a cut body must not end like a whole one

    get = post = put = patch = delete = options = _forward


class ForwardLiveHandler(ForwardHandler):
    """``/live``: open, like every host's, so that a kernel can tell that lemonkit answers here."""

    auth_required = False

    @allow_unauthenticated
    async def get(self, path: str) -> None:
        await self._forward(path)


class ForwardWebSocket(LemonkitWebSocket):
    """A WebSocket route, bridged to the same route of the service: messages pass both ways as they come."""

    _upstream_ws: websocket.WebSocketClientConnection | None = None

    async def open(self, path: str) -> None:
        self.set_nodelay(True)  # messages pass as they come (see LemonkitHandler.no_delay)
        upstream: Upstream = self.settings[UPSTREAM_KEY]
        try:
            service = await upstream.service()
            root = service.root.replace("http", "ws", 1)
            query = f"?{self.request.query}" if self.request.query else ""
            # no subprotocol is passed on: lemonkit's routes select none, and a browser's may carry its key
            request = httpclient.HTTPRequest(f"{root}/{path}{query}", headers=service.headers)
            self._upstream_ws = await websocket.websocket_connect(request, on_message_callback=self._from_upstream)
            if self.ws_connection is None:  # the client left while the service was being reached
                self._upstream_ws.close()
        except (LemonkitError, OSError, httpclient.HTTPClientError) as exc:
            err = exc if isinstance(exc, LemonkitError) else HubServiceError(f"The hub's service refused: {exc}")
            self.send_error_message(err)
            self.close(1011, err.message[:120])

    async def on_message(self, message: str | bytes) -> None:
        if self._upstream_ws is not None:
            with contextlib.suppress(websocket.WebSocketClosedError):
                await self._upstream_ws.write_message(message, binary=isinstance(message, bytes))

    def _from_upstream(self, message: str | bytes | None) -> None:
        if message is None:  # the service closed: so does this side, with its code and reason
            upstream = self._upstream_ws
            self.close(upstream.close_code if upstream else None, upstream.close_reason if upstream else None)
            return
        with contextlib.suppress(websocket.WebSocketClosedError):
            self.write_message(message, binary=isinstance(message, bytes))

    def on_close(self) -> None:
        if self._upstream_ws is not None:
            self._upstream_ws.close()


def build(root: str, host_base: type[Any], ws_base: type[Any]) -> list[tuple[str, type[Any]]]:
    """Tornado rules forwarding everything under ``root`` (see :func:`lemonkit.server.routes.build`)."""

    def host(cls: type[Any], base: type[Any]) -> type[Any]:
        return type(cls.__name__, (cls, base), {})

    bridge = host(ForwardWebSocket, ws_base)
    sockets = [path for path, _ in WS_ROUTES] + [p + path for p in API_PREFIXES for path, _ in VERSIONED_WS_ROUTES]
    rules: list[tuple[str, type[Any]]] = [(f"{root}({path})/?", bridge) for path in sockets]
    rules.append((f"{root}(live)/?", host(ForwardLiveHandler, host_base)))
    rules.append((f"{root}(.*)", host(ForwardHandler, host_base)))
    return rules
