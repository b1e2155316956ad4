"""The ``remote`` recipe: a model another server serves (vLLM, SGLang, llama-server, Ollama, KServe, Ray Serve,
another lemonkit), reached over its OpenAI-compatible API.

A loaded remote model is a :class:`~lemonkit.serving.loaded_model.LoadedModel` without a sidecar process: its
``client`` is an ``httpx.AsyncClient`` whose :class:`RemoteTransport` answers the sidecar's routes by forwarding
them upstream, so every handler serves it exactly as it serves a local model. The transport rewrites the body's
``model`` to the upstream's id, adds the upstream's key, balances requests across the model's URLs (round-robin),
fails over to the next URL when one cannot be reached before it answered anything (a stream that started is never
replayed), and turns every upstream error into lemonkit's ``{"error": {message, type, code}}``.

Nothing here runs in a sidecar: this module lives in the server process and only does network IO on its loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from lemonkit.backends.protocol import NO_STATS
from lemonkit.catalog.config import RemoteSettings
from lemonkit.catalog.model_info import ModelInfo
from lemonkit.errors import Forbidden, ModelLoadError

__all__ = [
    "SLOTS_PER_ENDPOINT",
    "Endpoint",
    "RemoteTransport",
    "Upstream",
    "check_hosts",
    "connect",
    "map_error",
    "read_api_key",
]

log = logging.getLogger("lemonkit.remote")

#: the sidecar routes a remote model answers -> the path under the upstream's base URL
ROUTES = {
    "/v1/chat/completions": "/chat/completions",
    "/v1/completions": "/completions",
    "/v1/embeddings": "/embeddings",
    "/v1/rerank": "/rerank",
}
#: request fields only lemonkit understands; ``encoding_format`` too: lemonkit encodes base64 itself, from floats
_LEMONKIT_ONLY = ("ctx_size", "route_trace", "encoding_format")
#: upstream statuses that say "not this replica, try another" (a gateway or a replica that is not ready)
_TRY_NEXT = frozenset({502, 503, 504})
#: seconds a failed endpoint goes to the back of the queue before it is tried first again
_COOLDOWN = 5.0
_CONNECT_TIMEOUT = 10.0
#: requests a remote model serves at once per URL (its "slots"): more wait their turn here, fairly per user on a
#: shared server, instead of piling onto an upstream that batches only so many
SLOTS_PER_ENDPOINT = 8


# -- operator policy ----------------------------------------------------------------------------------------------


def host_allowed(url: str, allowed: Iterable[str] | None) -> bool:
    """Whether ``url``'s host is one of ``allowed`` (``None``: any; ``".example.com"``: that domain; ``"*"``)."""
    if allowed is None:
        return True
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    for entry in allowed:
        entry = entry.strip().lower().rstrip(".")
        if entry == "*" or entry == host:
            return True
        if entry.startswith(".") and (host == entry[1:] or host.endswith(entry)):
            return True
    return False


def check_hosts(urls: Iterable[str], settings: RemoteSettings) -> None:
    """Refuse URLs whose host the operator did not allow.

    Raises:
        Forbidden: One names a host outside :attr:`RemoteSettings.allowed_hosts` (403 ``remote_host_not_allowed``).
    """
    refused = [url for url in urls if not host_allowed(url, settings.allowed_hosts)]
    if refused:
        allowed = ", ".join(settings.allowed_hosts or ()) or "none"
        raise Forbidden(
            f"This server may not send requests to {', '.join(refused)}: remote models may only name the hosts "
            f"its operator allowed ({allowed}; LEMONKIT_REMOTE_ALLOWED_HOSTS, lemonkit serve --remote-allowed-hosts, "
            "LemonkitExtension.remote_allowed_hosts)",
            code="remote_host_not_allowed",
        )


def _read_secrets(path: Path) -> dict[str, str]:
    """A secrets file: a JSON object, or dotenv lines (``VAR=key``, ``export VAR="key"``, ``#`` comments)."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        return {str(k): str(v) for k, v in data.items() if isinstance(v, str)}
    entries: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.removeprefix("export ").partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        entries[name.strip()] = value
    return entries


def read_api_key(name: str, settings: RemoteSettings) -> str:
    """The upstream key named ``name``: the server's environment variable, else the secrets file's entry.

    Blocking (it may read the secrets file): call it in a thread.

    Raises:
        ModelLoadError: Neither holds it, the secrets file is unreadable, or the key cannot travel in a header (the
            message never holds a key).
    """
    value = (os.environ.get(name) or "").strip()
    path = settings.secrets_file
    if not value and path is not None:
        try:
            value = (_read_secrets(path).get(name) or "").strip()
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"The secrets file {path} is unreadable ({type(exc).__name__}); fix it") from None
    if not value:
        where = f"nor in the secrets file {path}" if path is not None else "and no secrets file is set"
        raise ModelLoadError(f"api_key_env: {name} is not set in the server's environment {where}")
    # a header refused later would quote the key in its error: refuse it here, without quoting it
    if not (value.isascii() and value.isprintable()):
        raise ModelLoadError(f"api_key_env: the key in {name} holds characters an HTTP header cannot carry")
    return value


# -- endpoints and their errors -----------------------------------------------------------------------------------


@dataclass(eq=False)
class Endpoint:
    """One upstream base URL and what lemonkit saw of it."""

    url: str
    ok: bool | None = None
    last_error: str | None = None
    requests: int = 0
    failures: int = 0
    retry_at: float = 0.0

    def succeeded(self) -> None:
        self.ok = True

    def failed(self, reason: str) -> None:
        self.ok = False
        self.last_error = reason
        self.failures += 1
        self.retry_at = time.monotonic() + _COOLDOWN

    def health(self) -> dict[str, Any]:
        state = "unknown" if self.ok is None else "ok" if self.ok else "down"
        return {
            "url": self.url,
            "state": state,
            "last_error": self.last_error,
            "requests": self.requests,
            "failures": self.failures,
        }


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def map_error(status: int, raw: bytes, url: str) -> tuple[int, dict[str, Any]]:
    """An upstream's error answer as lemonkit's: ``(status, {"error": {message, type, code}})``.

    Understands OpenAI's and lemonkit's ``{"error": {...}}``, vLLM's ``{"object": "error", "message", ...}``,
    Ollama's and KServe's ``{"error": "..."}``, FastAPI's ``{"detail": ...}`` and plain text. An upstream 4xx stays
    the same 4xx, except 401/403 (the server's key for the upstream was refused, not the client's): those and
    every 5xx answer 502.

    Args:
        status: The upstream's HTTP status.
        raw: Its body.
        url: The upstream's base URL, named in the message.
    """
    message, kind, code = _upstream_detail(raw)
    message = message or f"HTTP {status}"
    if status in (401, 403):
        text = f"{url} refused this server's key for it ({status}: {message}); check the model's api_key_env"
        return 502, _body(text, "server_error", "upstream_auth_error")
    if status >= 500 or status < 400:
        return 502, _body(f"{url} failed ({status}): {message}", "server_error", "upstream_error")
    return status, _body(message, kind or "invalid_request_error", code or "upstream_error")


def _upstream_detail(raw: bytes) -> tuple[str, str | None, str | None]:
    text = raw.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500], None, None
    if not isinstance(data, dict):
        return text[:500], None, None
    detail = data.get("error", data if data.get("object") == "error" else None)
    if isinstance(detail, dict):
        kind, code = detail.get("type"), detail.get("code")
        return (
            str(detail.get("message") or detail.get("detail") or ""),
            kind if isinstance(kind, str) else None,
            code if isinstance(code, str) else None,
        )
    if isinstance(detail, str):
        return detail, None, None
    if "detail" in data:
        found = data["detail"]
        return (found if isinstance(found, str) else json.dumps(found)[:500]), None, None
    return text[:500], None, None


def _body(message: str, kind: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


# -- the transport ------------------------------------------------------------------------------------------------


class _Relay(httpx.AsyncByteStream):
    """An upstream answer's bytes as they arrive; a failure mid-body marks its endpoint down (and propagates)."""

    def __init__(self, response: httpx.Response, endpoint: Endpoint) -> None:
        self._response = response
        self._endpoint = endpoint

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            self._endpoint.failed(f"stopped mid-answer: {_describe(exc)}")
            raise

    async def aclose(self) -> None:
        await self._response.aclose()


class RemoteTransport(httpx.AsyncBaseTransport):
    """Answers the sidecar routes of :data:`ROUTES` (and ``/stats``) from upstream OpenAI-compatible servers.

    Args:
        name: The model's lemonkit id (for messages).
        checkpoint: The upstream's model id, written into every request's ``model``.
        endpoints: The upstreams, tried round-robin.
        api_key: Sent as ``Authorization: Bearer``.
        network: The transport that reaches them (default: httpx's, without its own retries).
    """

    def __init__(
        self,
        name: str,
        checkpoint: str,
        endpoints: list[Endpoint],
        *,
        api_key: str | None = None,
        network: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.name = name
        self.checkpoint = checkpoint
        self.endpoints = endpoints
        self._headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._network = network or httpx.AsyncHTTPTransport(retries=0)
        self._next = 0

    def order(self) -> list[Endpoint]:
        """The endpoints to try for the next request: round-robin, those that failed lately last."""
        count = len(self.endpoints)
        start, self._next = self._next % count, self._next + 1
        rotated = self.endpoints[start:] + self.endpoints[:start]
        now = time.monotonic()
        return sorted(rotated, key=lambda e: e.ok is False and e.retry_at > now)

    def rewrite(self, raw: bytes) -> bytes:
        """The request body as the upstream takes it: its model id, no lemonkit-only fields."""
        body = json.loads(raw) if raw else {}
        for key in _LEMONKIT_ONLY:
            body.pop(key, None)
        body["model"] = self.checkpoint
        return json.dumps(body).encode()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/stats":
            return httpx.Response(200, json=NO_STATS)  # the upstream's figures are not lemonkit's to know
        suffix = ROUTES.get(path)
        if suffix is None or request.method != "POST":
            message = f"{self.name} is a remote model: lemonkit forwards only {', '.join(ROUTES)} to its upstream"
            return httpx.Response(404, json=_body(message, "invalid_request_error", "not_supported_remotely"))
        try:
            content = self.rewrite(await request.aread())
        except (ValueError, AttributeError):
            return httpx.Response(
                400, json=_body("The request body is not a JSON object", "invalid_request_error", "invalid_json")
            )
        tried: list[str] = []
        for endpoint in self.order():
            outcome = await self._attempt(endpoint, suffix, content, request.extensions)
            if isinstance(outcome, httpx.Response):
                return outcome
            tried.append(f"{endpoint.url} ({outcome})")
        message = f"No upstream of {self.name} answered: {'; '.join(tried)}"
        return httpx.Response(502, json=_body(message, "server_error", "upstream_unreachable"))

    async def _attempt(
        self, endpoint: Endpoint, suffix: str, content: bytes, extensions: dict[str, Any]
    ) -> httpx.Response | str:
        """Send the request to ``endpoint``: the answer to give, or why the next endpoint should have it."""
        endpoint.requests += 1
        request = httpx.Request("POST", endpoint.url + suffix, headers=self._headers, content=content)
        request.extensions = extensions
        try:
            response = await self._network.handle_async_request(request)
        except httpx.TimeoutException as exc:
            endpoint.failed(_describe(exc))
            if isinstance(exc, httpx.ConnectTimeout):
                return _describe(exc)
            # it has the request and may still be working on it: running it again elsewhere would cost twice
            message = f"{endpoint.url} did not answer within the timeout (LEMONKIT_REMOTE_TIMEOUT)"
            return httpx.Response(504, json=_body(message, "server_error", "upstream_timeout"))
        except httpx.TransportError as exc:
            # refused, reset or closed before a byte of the answer: nothing reached the client, so try the next
            endpoint.failed(_describe(exc))
            return _describe(exc)
        if response.status_code == 200:
            endpoint.succeeded()
            headers = {"Content-Type": response.headers.get("Content-Type", "application/json")}
            return httpx.Response(200, headers=headers, stream=_Relay(response, endpoint))
        status, body = map_error(response.status_code, await _read_error(response), endpoint.url)
        if response.status_code in _TRY_NEXT:
            endpoint.failed(body["error"]["message"])
            return f"answered {response.status_code}"
        endpoint.succeeded()  # it answered: the request, not the endpoint, is at fault
        return httpx.Response(status, json=body)

    async def probe(self, endpoint: Endpoint) -> None:
        """Check that ``endpoint`` answers ``GET /models`` and, when it lists models, serves the checkpoint."""
        checkpoint = self.checkpoint
        try:
            response = await self._network.handle_async_request(
                httpx.Request(
                    "GET",
                    endpoint.url + "/models",
                    headers={k: v for k, v in self._headers.items() if k != "Content-Type"},
                    extensions={"timeout": httpx.Timeout(_CONNECT_TIMEOUT).as_dict()},
                )
            )
        except httpx.TransportError as exc:
            endpoint.failed(_describe(exc))
            return
        raw = await _read_error(response)
        if response.status_code in (404, 405):  # no model list (some KServe / Ray Serve ingresses): it answered
            endpoint.succeeded()
            return
        if response.status_code != 200:
            endpoint.failed(map_error(response.status_code, raw, endpoint.url)[1]["error"]["message"])
            return
        try:
            listed = [m.get("id") for m in json.loads(raw).get("data", []) if isinstance(m, dict)]
        except (ValueError, AttributeError):
            listed = []
        if listed and checkpoint not in listed:
            shown = ", ".join(str(m) for m in listed[:10])
            endpoint.failed(f"does not serve {checkpoint!r} (it lists: {shown})")
            return
        endpoint.succeeded()

    async def aclose(self) -> None:
        await self._network.aclose()


async def _read_error(response: httpx.Response) -> bytes:
    try:
        return await response.aread()
    except httpx.TransportError:
        return b""
    finally:
        await response.aclose()


# -- loading ------------------------------------------------------------------------------------------------------


class Upstream:
    """A loaded remote model's endpoints and the client that reaches them (its ``LoadedModel.client``)."""

    def __init__(self, transport: RemoteTransport, timeout: float) -> None:
        self.transport = transport
        self.client = httpx.AsyncClient(
            transport=transport, base_url="http://remote", timeout=httpx.Timeout(timeout, connect=_CONNECT_TIMEOUT)
        )

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.transport.endpoints

    @property
    def slots(self) -> int:
        """Requests served at once: :data:`SLOTS_PER_ENDPOINT` per URL."""
        return SLOTS_PER_ENDPOINT * len(self.endpoints)

    def health(self) -> list[dict[str, Any]]:
        """Each endpoint's state, for ``/v1/health``."""
        return [e.health() for e in self.endpoints]

    async def aclose(self) -> None:
        await self.client.aclose()


async def connect(info: ModelInfo, settings: RemoteSettings, api_key: str | None) -> Upstream:
    """Reach ``info``'s upstreams: the model is loaded when at least one answers and serves its checkpoint.

    Args:
        info: A ``remote`` model.
        settings: The operator's remote settings (allowed hosts, timeout).
        api_key: The upstream key (see :func:`read_api_key`), if the model names one.

    Raises:
        Forbidden: A URL names a host the operator no longer allows.
        ModelLoadError: No endpoint answered, each reason named.
    """
    assert info.remote is not None
    check_hosts(info.remote.urls, settings)
    endpoints = [Endpoint(url) for url in info.remote.urls]
    upstream = Upstream(RemoteTransport(info.id, info.checkpoint, endpoints, api_key=api_key), settings.timeout)
    await asyncio.gather(*(upstream.transport.probe(endpoint) for endpoint in endpoints))
    if not any(e.ok for e in endpoints):
        await upstream.aclose()
        reasons = "; ".join(f"{e.url}: {e.last_error}" for e in endpoints)
        raise ModelLoadError(f"Failed to load {info.id}: no upstream answered ({reasons})")
    return upstream
