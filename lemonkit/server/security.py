"""Which browser pages may talk to the standalone host: a ``Host`` allow-list and an ``Origin`` policy.

A local server is reachable from any web page its user opens. Two attacks need no credentials:

- DNS rebinding: a page on ``evil.example`` rebinds its own name to 127.0.0.1, so the browser sends the
  page's requests, and lets it read the answers, to this server. Its requests name ``evil.example`` in
  ``Host``: only names of this server are accepted.
- Cross-site requests: a page's ``fetch`` or form posts here directly (a ``text/plain`` POST needs no
  preflight). Browsers name the page in ``Origin``: only this server's own origin and the operator's allowed
  origins are accepted, and only those get CORS headers.

Accepted ``Host`` names:

- always: ``localhost``, ``*.localhost`` and any IP literal (a rebinding page sends a name, never an IP: a
  browser that connects to an IP literal reaches that address, not this server through a name);
- bound beyond loopback (``--host 0.0.0.0``, a LAN address or a name): also the machine's host name and the
  ``--host`` name itself; any other name a client uses (a DNS name, a reverse proxy's) must be allowed;
- ``--allowed-hosts`` / ``LEMONKIT_ALLOWED_HOSTS``: comma-separated names, ``.example.com`` or
  ``*.example.com`` for a domain and its subdomains, ``*`` for any name (the check is off: logged as a warning).

Accepted origins: the server's own (``http://`` plus the request's ``Host``) and ``--allowed-origins`` /
``LEMONKIT_ALLOWED_ORIGINS`` (comma-separated ``scheme://host[:port]``; ``*`` for any, logged as a warning).
Behind a TLS-terminating proxy the page's ``https://`` origin is not the server's own: allow it there.

An empty name (``Host: :13305``) and a missing ``Host`` (HTTP/1.0) are refused. Requests without ``Origin``
(curl, the openai SDK, any non-browser client) are never refused for their origin. ``/live`` needs no key but
keeps both checks: a foreign page learns nothing from it, not even that a server is there.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from lemonkit.errors import ForbiddenHost, ForbiddenOrigin

if TYPE_CHECKING:
    from tornado.httputil import HTTPServerRequest

__all__ = ["POLICY_KEY", "BrowserPolicy", "is_loopback", "split_list"]

#: key of the :class:`BrowserPolicy` in ``tornado.web.Application.settings``
POLICY_KEY = "lemonkit_browser_policy"

#: headers a browser page may send cross-origin (besides the CORS-safelisted ones)
ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key"

_HOST = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]/@\s]*))(?::(?P<port>\d{1,5}))?$")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def split_list(value: str | Iterable[str] | None) -> list[str]:
    """Comma-separated (or already split) entries, stripped and lowercased, empty ones dropped."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip().lower() for item in items if item.strip()]


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(address: str) -> bool:
    """Whether a bound address (or ``--host`` value) only listens on this machine."""
    ip = _ip(address.strip("[]"))
    return ip.is_loopback if ip is not None else address.lower().rstrip(".") == "localhost"


def _host_name(header: str | None) -> tuple[str, int | None] | None:
    """``(name, port)`` of a ``Host`` header (the name lowercased, without IPv6 brackets or a final dot);
    ``None`` when it is missing, malformed or names nothing."""
    match = _HOST.match((header or "").strip())
    if match is None:
        return None
    name = (match["v6"] or match["name"] or "").lower().removesuffix(".")
    if not name or (match["v6"] and _ip(name) is None):
        return None
    port = match["port"]
    return name, int(port) if port else None


def _origin(scheme: str, host: str | None) -> tuple[str, str, int] | None:
    """``(scheme, name, port)`` of an origin, default ports filled in; ``None`` when it is not one."""
    parsed = _host_name(host)
    if parsed is None or scheme not in _DEFAULT_PORTS:
        return None
    name, port = parsed
    return scheme, name, port if port is not None else _DEFAULT_PORTS[scheme]


def _parse_origin(value: str) -> tuple[str, str, int] | None:
    parts = urlsplit(value.strip())
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        return None
    return _origin(parts.scheme.lower(), parts.netloc)


@dataclass(frozen=True)
class BrowserPolicy:
    """The standalone host's ``Host`` and ``Origin`` rules (see the module's doc).

    Args:
        names: Host names accepted besides ``localhost``, ``*.localhost`` and IP literals (lowercase).
        suffixes: Domains whose subdomains (and themselves) are accepted, each starting with ``.``.
        any_host: ``*`` was allowed: the ``Host`` check is off.
        origins: Origins (``scheme://name:port``) accepted besides the server's own, with CORS answers.
        any_origin: ``*`` was allowed: every origin is accepted (and echoed, never ``*``).
        local_only: The server listens on loopback addresses only.
    """

    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()
    any_host: bool = False
    origins: frozenset[tuple[str, str, int]] = frozenset()
    any_origin: bool = False
    local_only: bool = True

    @classmethod
    def create(
        cls,
        bound: Iterable[str],
        allowed_hosts: str | Iterable[str] | None = None,
        allowed_origins: str | Iterable[str] | None = None,
    ) -> BrowserPolicy:
        """The policy of a server listening on ``bound`` (its ``--host`` value and bound addresses).

        Args:
            bound: The ``--host`` value and the addresses the sockets are bound to.
            allowed_hosts: Extra host names (default: ``$LEMONKIT_ALLOWED_HOSTS``).
            allowed_origins: Extra origins (default: ``$LEMONKIT_ALLOWED_ORIGINS``).

        Raises:
            ValueError: An allowed origin is not ``scheme://host[:port]`` or ``*``.
        """
        hosts = split_list(os.environ.get("LEMONKIT_ALLOWED_HOSTS") if allowed_hosts is None else allowed_hosts)
        origins = split_list(os.environ.get("LEMONKIT_ALLOWED_ORIGINS") if allowed_origins is None else allowed_origins)
        bound = [b.strip("[]").lower() for b in bound if b]
        names = {b for b in bound if _ip(b) is None}
        local_only = all(is_loopback(b) for b in bound)
        if not local_only:
            # reachable from other machines: they may call it by this machine's name
            names.add(socket.gethostname().lower())
        suffixes = tuple("." + h.lstrip("*.") for h in hosts if h.startswith((".", "*.")))
        names.update(h.rstrip(".") for h in hosts if not h.startswith((".", "*.")) and h != "*")
        parsed = {o: _parse_origin(o) for o in origins if o != "*"}
        bad = [o for o, p in parsed.items() if p is None]
        if bad:
            raise ValueError(f"allowed origins must look like 'http://host:port', got {', '.join(bad)}")
        return cls(
            names=frozenset(names),
            suffixes=suffixes,
            any_host="*" in hosts,
            origins=frozenset(p for p in parsed.values() if p is not None),
            any_origin="*" in origins,
            local_only=local_only,
        )

    def warnings(self, api_key: str | None) -> list[str]:
        """What an operator must know at start-up about this policy on a server with this key."""
        found = []
        if not self.local_only and not api_key:
            found.append(
                "lemonkit is listening beyond this machine with no API key: anyone who can reach it can run "
                "models, pull and delete them, and install packages. Set LEMONADE_API_KEY to require a key, "
                "or serve on 127.0.0.1"
            )
        if self.any_host:
            found.append(
                "allowed hosts include '*': requests naming any Host are served, so a web page can reach this "
                "server through DNS rebinding"
            )
        if self.any_origin:
            found.append("allowed origins include '*': every web page the user opens may call this server")
        return found

    # -- checks ----------------------------------------------------------------------------------------------

    def host_allowed(self, name: str) -> bool:
        if self.any_host or _ip(name) is not None or name == "localhost" or name.endswith(".localhost"):
            return True
        return name in self.names or any(name.endswith(s) or name == s[1:] for s in self.suffixes)

    def accepts_host(self, header: str | None) -> bool:
        """Whether a request with this ``Host`` header may be served."""
        if self.any_host:
            return True
        parsed = _host_name(header)
        return parsed is not None and self.host_allowed(parsed[0])

    def check(self, request: HTTPServerRequest) -> None:
        """Refuse a request whose ``Host`` is not this server's or whose ``Origin`` is not accepted.

        Raises:
            ForbiddenHost: ``Host`` is missing, empty, malformed or names another server.
            ForbiddenOrigin: A browser page of a foreign origin sent the request.
        """
        header = request.headers.get("Host")
        if not self.accepts_host(header):
            shown = "no Host header" if header is None else f"Host {header[:100]!r}"
            raise ForbiddenHost(
                f"Refused a request with {shown}: this server answers only to its own names; "
                "add a reverse proxy's name with --allowed-hosts or LEMONKIT_ALLOWED_HOSTS"
            )
        origin = request.headers.get("Origin")
        if origin is not None and not (self._same_origin(request, origin) or self.origin_allowed(origin)):
            raise ForbiddenOrigin(
                f"Refused a request from the web page origin {origin[:100]!r}; allow it with --allowed-origins "
                "or LEMONKIT_ALLOWED_ORIGINS"
            )

    def origin_allowed(self, origin: str) -> bool:
        """Whether ``origin`` may call this server cross-origin (and gets CORS headers)."""
        parsed = _parse_origin(origin)
        return parsed is not None and (self.any_origin or parsed in self.origins)

    @staticmethod
    def _same_origin(request: HTTPServerRequest, origin: str) -> bool:
        own = _origin(request.protocol, request.headers.get("Host"))
        return own is not None and own == _parse_origin(origin)
