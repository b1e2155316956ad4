"""The JupyterHub host: ``lemonkit serve --jupyterhub-service``, one server that many hub users share.

The hub starts it as a managed service (``c.JupyterHub.services``) and gives it its environment:
``JUPYTERHUB_SERVICE_URL`` (where to listen), ``JUPYTERHUB_SERVICE_PREFIX`` (where the hub's proxy mounts it,
``/services/lemonkit/``), ``JUPYTERHUB_API_URL``, ``JUPYTERHUB_API_TOKEN``, ``JUPYTERHUB_CLIENT_ID`` and
``JUPYTERHUB_SERVICE_NAME``, which jupyterhub's own :class:`~jupyterhub.services.auth.HubOAuth` reads.

Who may call it: a hub token (``Authorization: token|Bearer <t>``, ``?token=`` on WebSockets) or, for browsers,
the OAuth cookie this service sets at ``<prefix>oauth_callback``; its scopes must include
``access:services!service=<name>``. Admins of the service (hub admins, or holders of the configured admin scope,
e.g. ``custom:lemonkit:admin``) may change what every user shares.

Browser pages of other origins: cookie-authenticated requests that change anything need jupyterhub's XSRF token
(the library refuses the cookie otherwise), and a cross-origin ``Origin`` with a cookie is refused outright; no
CORS headers are ever sent. A token-authenticated request carries its own credential and is not origin-checked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler, HubOAuthenticated, UserNotAllowed
from tornado import web, websocket
from tornado.httpserver import HTTPServer

from lemonkit.catalog.config import Settings
from lemonkit.errors import Forbidden, ForbiddenOrigin, Unauthorized
from lemonkit.server import batches, routes
from lemonkit.server.handler import LemonkitHandler
from lemonkit.server.service import SETTINGS_KEY, Service
from lemonkit.serving.caller import Caller
from lemonkit.serving.log_store import redact_logs

__all__ = [
    "HubHandler",
    "HubSettings",
    "HubWebSocketHandler",
    "make_app",
    "serve",
]

log = logging.getLogger("lemonkit.server")


if TYPE_CHECKING:
    _HandlerBase = web.RequestHandler
else:
    _HandlerBase = object  # joined to a Tornado handler class by each host base below


@dataclass(frozen=True)
class HubSettings:
    """What the hub host needs beyond :class:`~lemonkit.catalog.config.Settings`.

    Args:
        prefix: Where the hub's proxy mounts the service (``JUPYTERHUB_SERVICE_PREFIX``), ending in ``/``.
        host: The interface to listen on (from ``JUPYTERHUB_SERVICE_URL``).
        port: The port to listen on (from ``JUPYTERHUB_SERVICE_URL``).
    """

    prefix: str
    host: str
    port: int

    @classmethod
    def from_env(cls) -> HubSettings:
        """The settings the hub gave this service in its environment.

        Raises:
            ValueError: The hub's variables are missing (not started by a hub) or malformed.
        """
        missing = [v for v in ("JUPYTERHUB_SERVICE_URL", "JUPYTERHUB_API_TOKEN") if not os.environ.get(v)]
        if missing:
            raise ValueError(
                f"--jupyterhub-service needs the environment a JupyterHub gives its managed services "
                f"(missing {', '.join(missing)}); add lemonkit to c.JupyterHub.services (see docs/jupyterhub.md)"
            )
        url = urlsplit(os.environ["JUPYTERHUB_SERVICE_URL"])
        if url.scheme != "http" or not url.hostname or url.port is None:
            raise ValueError(f"JUPYTERHUB_SERVICE_URL must be http://host:port, got {url.geturl()!r}")
        prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX") or "/services/lemonkit/"
        return cls(prefix=prefix.rstrip("/") + "/", host=url.hostname, port=url.port)


class _HubAuth(HubOAuth):
    """jupyterhub's OAuth client, also reading ``?token=`` on every WebSocket request: the library does only for
    browsers' (``Sec-Fetch-Mode: websocket``), and other clients cannot always set a WebSocket's headers. Other
    routes keep the library's rule (no tokens in URLs, where they would leak into logs and history)."""

    def get_token(self, handler: web.RequestHandler, in_cookie: bool = True) -> str | None:
        token: str | None = super().get_token(handler, in_cookie=False)
        if not token and isinstance(handler, websocket.WebSocketHandler):
            token = handler.get_query_argument("token", "") or None
        if not token and in_cookie:
            token = self._get_token_cookie(handler)
        return token


class _HubGuard(HubOAuthenticated, _HandlerBase):
    """Authentication and authorisation both hub bases share, through jupyterhub's :class:`HubOAuthenticated`."""

    hub_auth_class = _HubAuth
    #: whether a cookie-authenticated GET sets jupyterhub's ``_xsrf`` cookie (not on a WebSocket's upgrade)
    _offers_xsrf = True

    async def prepare(self) -> None:
        if not getattr(self, "auth_required", True):
            return
        user = await self.hub_auth.get_user(self, sync=False)  # token first, then the OAuth cookie (with XSRF)
        if user is None:
            if self._wants_login_page():
                self.redirect(self.get_login_url())
                return
            if self.request.method not in ("GET", "HEAD") and self.get_secure_cookie(self.hub_auth.cookie_name):
                raise Forbidden(
                    "A hub login cookie needs jupyterhub's XSRF token on writes: send the _xsrf cookie's value "
                    "as the X-XSRFToken header (or use a token)",
                    code="xsrf_required",
                )
            raise Unauthorized(
                "Hub credentials are required: send 'Authorization: token <your JupyterHub API token>' "
                "(or Bearer), or log in through the hub in a browser"
            )
        try:
            self.check_hub_user(user)
        except UserNotAllowed:
            raise Forbidden(
                f"Hub {user.get('kind', 'user')} {user.get('name')!r} may not use this service: the token "
                f"needs the scope {' or '.join(sorted(self.hub_scopes or ()))}"
            ) from None
        self._check_cookie_origin()
        self._hub_auth_user_cache = user  # current_user, without HubAuthenticated's blocking lookup
        if self._offers_xsrf and self.request.method == "GET" and not getattr(self, "_token_authenticated", False):
            self.xsrf_token  # noqa: B018 -- jupyterhub sets the _xsrf cookie a page's script sends back on writes
        admin_scope = self.settings[SETTINGS_KEY].settings.hub_admin_scope
        scopes = frozenset(user.get("scopes") or ())
        admin = bool(user.get("admin")) or admin_scope in scopes
        self.set_caller(Caller(str(user["name"]), admin=admin, scopes=scopes, shared=True))

    def _wants_login_page(self) -> bool:
        """A browser navigating here (a GET asking for HTML) is sent to the hub's login, like any hub page."""
        accept = self.request.headers.get("Accept", "")
        return self.request.method in ("GET", "HEAD") and "text/html" in accept

    def _check_cookie_origin(self) -> None:
        """A page of another origin must not use the user's cookie, even for reads (the answer is theirs).

        The hub's own origin is the ``Host`` the proxy passed on, or the ``X-Forwarded-Host`` of a proxy in front
        of it that rewrote ``Host`` (a page cannot send that header cross-origin: it is not CORS-safelisted).
        """
        if getattr(self, "_token_authenticated", False):
            return
        origin = self.request.headers.get("Origin")
        if origin is None:
            return
        forwarded = self.request.headers.get("X-Forwarded-Host", "").split(",")[0].strip()
        if urlsplit(origin).netloc.lower() not in {self.request.host.lower(), forwarded.lower()} - {""}:
            raise ForbiddenOrigin(f"A page of {origin} may not use a hub login cookie here")


class HubHandler(_HubGuard, web.RequestHandler):
    """Host base: hub token or OAuth cookie with the service's access scope on every route but ``/live``."""


class HubWebSocketHandler(_HubGuard, websocket.WebSocketHandler):
    """Host base of the WebSocket routes: the same checks in ``prepare``, so a refused client gets a JSON 401 or
    403 and no upgrade. A token may come as ``?token=`` (jupyterhub reads it on WebSocket requests)."""

    _offers_xsrf = False

    def _wants_login_page(self) -> bool:
        return False

    def check_origin(self, origin: str) -> bool:
        return True  # prepare() refused a cookie from another origin; a token is a credential wherever it comes from


class _OAuthCallback(LemonkitHandler, HubOAuthCallbackHandler):
    """jupyterhub's own OAuth callback (``<prefix>oauth_callback``); its errors are JSON like every answer."""

    hub_auth_class = _HubAuth


def make_app(service: Service, hub: HubSettings) -> web.Application:
    """The Tornado application serving every lemonkit route under the hub's prefix.

    Args:
        service: The server's state.
        hub: The hub host's settings.
    """
    rules: list[tuple[str, type[Any]]] = [(f"{hub.prefix}oauth_callback", _OAuthCallback)]
    rules += routes.build(hub.prefix, HubHandler, HubWebSocketHandler)
    settings: dict[str, Any] = {
        SETTINGS_KEY: service,
        "cookie_secret": os.urandom(32),  # signs the OAuth state and token cookies of this process
        "websocket_ping_interval": 30,
        "default_handler_class": rules[-1][1],
    }
    return web.Application(rules, **settings)


async def serve(hub: HubSettings, settings: Settings | None = None, *, preload: str | None = None) -> None:
    """Serve as the hub's managed service until SIGINT/SIGTERM, then unload every model.

    Args:
        hub: Where to listen and what the prefix and admin scope are.
        settings: Deployment settings (defaults from the environment).
        preload: A model to load before serving.
    """
    redact_logs()  # ?token= must not reach a log line
    _HubAuth.instance()  # reads the hub's variables now: a misconfigured service fails at start, not per request
    service = Service(settings)
    batches.start(service)
    service.settings.api_key = None  # the hub's tokens guard every route
    server = HTTPServer(make_app(service, hub), xheaders=True)  # the hub's proxy sets X-Forwarded-*
    server.listen(hub.port, address=hub.host)
    if preload:
        await service.manager.load((await service.usable(preload)).id)
    log.info("lemonkit serving as a JupyterHub service on http://%s:%s%s", hub.host, hub.port, hub.prefix)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.stop()
        await service.close()
