"""Finding the JupyterHub's shared lemonkit service from inside a user's single-user server (or its kernels).

A single-user server and its kernels carry the hub's environment: ``JUPYTERHUB_API_URL`` and
``JUPYTERHUB_API_TOKEN`` (a token of this user). The service, named by ``LEMONKIT_HUB_SERVICE`` (default
``lemonkit``), is looked up with that token through the hub's REST API (``GET {api}/services/{name}``, which
needs the scope ``read:services!service={name}``); its model gives ``url`` (where it listens, reachable from a
kernel on the hub's network) and ``prefix`` (its path behind the hub's proxy, reachable at the hub's public URL).
Requests then carry ``Authorization: token <JUPYTERHUB_API_TOKEN>``, which the service checks against the hub.

Whether the service is *meant* for this user decides between falling back and failing:

- the hub says there is no such service, or the token neither reads nor may access one of that name: it is not
  configured, and discovery moves on (to this kernel's Jupyter server, a local server, an embedded one) —
  unless this user's configuration asks for the hub (``LEMONKIT_HUB_SERVICE`` or ``LEMONKIT_FORWARD_TO_HUB`` set),
  which makes it an error;
- the token may use the service but not read where it is: it is tried at its fixed prefix through the hub's
  public URL when the hub has one (``JUPYTERHUB_PUBLIC_HUB_URL``), else an error;
- the service does not answer: an error, always.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from lemonkit.errors import HubServiceError

__all__ = ["DEFAULT_SERVICE", "FORWARD_ENV", "SERVICE_ENV", "HubEnvironment", "HubService", "find", "forget"]

SERVICE_ENV = "LEMONKIT_HUB_SERVICE"
FORWARD_ENV = "LEMONKIT_FORWARD_TO_HUB"
DEFAULT_SERVICE = "lemonkit"
#: how long one question to the hub, or one probe of the service, may take
_TIMEOUT = 5.0
_TRUE = ("1", "true", "yes", "on")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in _TRUE


@dataclass(frozen=True)
class HubEnvironment:
    """What this process knows about its hub.

    Attributes:
        api_url: The hub's REST API (``JUPYTERHUB_API_URL``, e.g. ``http://127.0.0.1:8081/hub/api``).
        token: This user's token (``JUPYTERHUB_API_TOKEN``).
        service: The lemonkit service's name.
        required: This user's configuration asks for the hub's service: a missing one is an error, not a fallback.
        public_hub_url: The hub's public URL (``JUPYTERHUB_PUBLIC_HUB_URL``; empty unless the hub sets ``public_url``).
        base_url: The hub's base URL (``JUPYTERHUB_BASE_URL``), which services' prefixes start with.
    """

    api_url: str
    token: str
    service: str = DEFAULT_SERVICE
    required: bool = False
    public_hub_url: str = ""
    base_url: str = "/"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, required: bool = False) -> HubEnvironment | None:
        """The hub this process runs under, or ``None`` outside one.

        Args:
            environ: The environment (default: this process's).
            required: Ask for the hub's service whatever the environment says (the forwarding extension).
        """
        env = os.environ if environ is None else environ
        api, token = env.get("JUPYTERHUB_API_URL"), env.get("JUPYTERHUB_API_TOKEN")
        if not api or not token:
            return None
        named = env.get(SERVICE_ENV, "").strip()
        return cls(
            api_url=api.rstrip("/"),
            token=token,
            service=named or DEFAULT_SERVICE,
            required=required or bool(named) or _truthy(env.get(FORWARD_ENV)),
            public_hub_url=env.get("JUPYTERHUB_PUBLIC_HUB_URL", ""),
            base_url=env.get("JUPYTERHUB_BASE_URL") or "/",
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}


@dataclass(frozen=True)
class HubService:
    """The hub's lemonkit service, as a client reaches it.

    Attributes:
        root: Its mount point (the API is at ``root + "/api/v1"``), e.g. ``http://127.0.0.1:10101/services/lemonkit``.
        token: The user's hub token, sent as ``Authorization: token ...``.
        name: The service's name on the hub.
    """

    root: str
    token: str
    name: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}


_lock = threading.Lock()
_found: dict[HubEnvironment, HubService | None] = {}


def find(hub: HubEnvironment | None = None) -> HubService | None:
    """The hub's lemonkit service for this user, asked once per process (per hub, token and name).

    Args:
        hub: The hub (default: :meth:`HubEnvironment.from_env`).

    Returns:
        The service, or ``None`` outside a hub or when the hub has none for this user (and none is required).

    Raises:
        HubServiceError: The service is required but missing, the token may use it but not see where it is,
            the hub does not answer while the service is required, or the service does not answer.
    """
    hub = HubEnvironment.from_env() if hub is None else hub
    if hub is None:
        return None
    with _lock:
        if hub not in _found:
            _found[hub] = _look_up(hub)  # errors are not remembered: the next call asks again
        return _found[hub]


def forget() -> None:
    """Drop what :func:`find` remembered (a hub that changed, tests)."""
    with _lock:
        _found.clear()


def _look_up(hub: HubEnvironment) -> HubService | None:
    model = _service_model(hub)
    if model is None:
        return None
    for root in _roots(hub, model):
        if _answers(root, hub):
            return HubService(root, hub.token, hub.service)
    tried = " or ".join(_roots(hub, model)) or "nowhere (the hub gives neither its url nor a public URL)"
    raise HubServiceError(
        f"The JupyterHub service {hub.service!r} does not answer at {tried}; is it running? (the hub's admin can "
        f"see its log)",
        code="hub_service_unavailable",
    )


def _service_model(hub: HubEnvironment) -> dict[str, Any] | None:
    """The hub's model of the service (with ``url`` and ``prefix``); ``None`` when it is not configured."""
    name = quote(hub.service, safe="")
    try:
        response = httpx.get(f"{hub.api_url}/services/{name}", headers=hub.headers, timeout=_TIMEOUT)
    except httpx.HTTPError as exc:
        if hub.required:
            raise HubServiceError(
                f"The JupyterHub API at {hub.api_url} does not answer ({exc}), so its lemonkit service "
                f"{hub.service!r} cannot be found",
                code="hub_unreachable",
            ) from None
        return None
    if response.status_code == 200:
        model: dict[str, Any] = response.json()
        return model
    if response.status_code == 404:
        _unless_required(hub, f"the hub has no service named {hub.service!r}", "hub_service_not_found")
        return None
    if response.status_code == 403:
        if _may_access(hub):
            if hub.public_hub_url:  # a managed service's prefix is fixed: reach it through the public proxy
                return {"url": "", "prefix": f"{hub.base_url.rstrip('/')}/services/{name}/"}
            raise HubServiceError(
                f"This JupyterHub token may use the service {hub.service!r} but not read where it is: the hub's "
                f"admin must grant 'read:services!service={hub.service}' (for a single-user server's token, in "
                f"c.Spawner.server_token_scopes) or set the hub's public_url; or set LEMONKIT_URL to the service's "
                f"URL",
                status=403,
                code="hub_access_denied",
            )
        _unless_required(
            hub,
            f"this JupyterHub token has no access to the service {hub.service!r} (it needs the scopes "
            f"'access:services!service={hub.service}' and 'read:services!service={hub.service}')",
            "hub_access_denied",
            status=403,
        )
        return None
    raise HubServiceError(
        f"The JupyterHub API answered {response.status_code} for the service {hub.service!r}: {response.text[:200]}",
        code="hub_unreachable",
    )


def _unless_required(hub: HubEnvironment, why: str, code: str, status: int = 404) -> None:
    """A service that is not there for this user is an error only when their configuration asks for it."""
    if hub.required:
        raise HubServiceError(
            f"lemonkit is set to use the JupyterHub's service ({SERVICE_ENV}, {FORWARD_ENV} or the extension's "
            f"forward_to_hub), but {why}",
            status=status,
            code=code,
        )


def _may_access(hub: HubEnvironment) -> bool:
    """Whether the token holds the service's access scope (the hub tells a token its own scopes)."""
    try:
        response = httpx.get(f"{hub.api_url}/user", headers=hub.headers, timeout=_TIMEOUT)
        scopes = response.json().get("scopes", []) if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
    return any(s in ("access:services", f"access:services!service={hub.service}") for s in scopes)


def _roots(hub: HubEnvironment, model: dict[str, Any]) -> list[str]:
    """Where the service may be reached, best first: where it listens, then through the hub's public proxy."""
    prefix = "/" + str(model.get("prefix") or f"/services/{hub.service}/").strip("/")
    roots = []
    if model.get("url"):
        direct = urlsplit(str(model["url"]))
        roots.append(f"{direct.scheme}://{direct.netloc}{prefix}")
    if hub.public_hub_url:
        public = urlsplit(hub.public_hub_url)
        roots.append(f"{public.scheme}://{public.netloc}{prefix}")
    return roots


def _answers(root: str, hub: HubEnvironment) -> bool:
    """Whether lemonkit answers at ``root`` (``/live``; the token goes along in case a proxy wants one)."""
    try:
        response = httpx.get(f"{root}/live", headers=hub.headers, timeout=_TIMEOUT)
    except httpx.HTTPError:
        return False
    return response.status_code == 200
