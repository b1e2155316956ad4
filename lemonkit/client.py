"""How Python code reaches a lemonkit server: :class:`Client` and :class:`AsyncClient` (httpx).

The Python API, the widgets and the ``lemonkit`` management commands talk to a server only through these. A client
built without a URL finds its server at the first request, taking the first of:

1. ``LEMONKIT_URL`` (a host root such as ``http://127.0.0.1:13305``, a Jupyter server's
   ``http://host:8888/lemonkit``, or a full ``.../api/v1``), with ``LEMONKIT_TOKEN`` or ``LEMONADE_API_KEY``;
2. under JupyterHub, the hub's shared lemonkit service (``LEMONKIT_HUB_SERVICE``, default ``lemonkit``), found
   through the hub's REST API with this user's ``JUPYTERHUB_API_TOKEN`` (see :mod:`lemonkit.hub_discovery`);
3. the Jupyter server this kernel belongs to, with its token (JupyterHub's API token when it has none);
4. a ``lemonkit serve`` of this user, the one on port 13305 first, found through its record in Jupyter's runtime
   directory (with its key; see :mod:`lemonkit.server_records`): a server no record vouches for, such as another
   user's on a shared machine, is never used;
5. an embedded standalone server started in the background on a free port, with a random key, that exits with
   this process (it watches its stdin).

Errors come back as the server's own exception classes (:mod:`lemonkit.errors`), found by the answer's ``code``,
so ``except lemonkit.ModelNotFound`` works on either side of the wire; a server that cannot be reached raises
:class:`ServerUnavailable`.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import selectors
import subprocess
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent

from lemonkit import hub_discovery, server_records
from lemonkit.audio_methods import AsyncAudioMethods, SyncAudioMethods
from lemonkit.chat_methods import AsyncMethods, SyncMethods
from lemonkit.config import DEFAULT_PORT
from lemonkit.errors import InvalidArgument, LemonkitError, RetryLater, ServerUnavailable, error_from_body
from lemonkit.image_methods import AsyncImageMethods, SyncImageMethods

__all__ = ["AsyncClient", "Client", "Event", "Server", "ServerUnavailable", "default_client", "locate"]

#: how long a probe of a candidate server may take before the next candidate is tried
_PROBE_TIMEOUT = 3.0
#: how long an embedded server may take to start listening
_START_TIMEOUT = 120.0
_TIMEOUT = httpx.Timeout(60.0, read=None)  # streams (pulls, generations) may be silent for long


@dataclass(frozen=True)
class Server:
    """Where a client sends its requests.

    Attributes:
        api: The API root, ending ``/api/v1``.
        token: Sent as ``Authorization: <scheme> <token>``; ``None`` sends nothing.
        kind: How it was found: ``"url"``, ``"jupyterhub"``, ``"jupyter"``, ``"standalone"`` or ``"embedded"``.
        scheme: The Authorization scheme (JupyterHub's own is ``token``).
    """

    api: str
    token: str | None
    kind: str
    scheme: str = "Bearer"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"{self.scheme} {self.token}"} if self.token else {}


@dataclass(frozen=True)
class Event:
    """One server-sent event: ``name`` is its ``event:`` line (``"message"`` without one)."""

    name: str
    data: Any


def api_root(url: str) -> str:
    """``url`` as an API root: a host root gets ``/api/v1``, a URL already ending in a version is kept."""
    url = url.rstrip("/")
    return url if re.search(r"/(api/)?v[01]$", url) else url + "/api/v1"


def host_root(api: str) -> str:
    """The mount point an API root hangs off (where ``/live`` is): ``api_root``'s inverse."""
    return re.sub(r"/(api/)?v[01]$", "", api.rstrip("/"))


def locate(*, start: bool = True) -> Server:
    """Find the server a client without a URL talks to (the module doc gives the order).

    Args:
        start: Start the embedded server when nothing else answers.

    Raises:
        ServerUnavailable: ``LEMONKIT_URL`` does not answer, or nothing does and ``start`` is false, or the
            embedded server failed to start.
        HubServiceError: Under JupyterHub, the hub's service is required but missing, or it is there for this
            user but cannot be read or reached (see :mod:`lemonkit.hub_discovery`).
    """
    token = os.environ.get("LEMONKIT_TOKEN") or os.environ.get("LEMONADE_API_KEY") or None
    url = os.environ.get("LEMONKIT_URL")
    if url:
        server = Server(api_root(url), token, "url")
        if not _answers(server):
            raise ServerUnavailable(f"LEMONKIT_URL names {url}, but no lemonkit server answers there")
        return server
    hub = hub_discovery.find()
    if hub is not None:
        return Server(hub.root + "/api/v1", hub.token, "jupyterhub", scheme="token")
    found = _jupyter_server()
    if found is not None:
        return found
    local = _recorded(token)
    if local is not None:
        return local
    if not start:
        raise ServerUnavailable(
            f"No lemonkit server is running (none at LEMONKIT_URL, this kernel's Jupyter server or port "
            f"{DEFAULT_PORT}); start one with `lemonkit serve`"
        )
    return _embedded()


def _answers(server: Server) -> bool:
    """Whether a lemonkit server listens at ``server`` (``/live`` needs no credentials)."""
    try:
        response = httpx.get(host_root(server.api) + "/live", timeout=_PROBE_TIMEOUT)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def _recorded(token: str | None) -> Server | None:
    """This user's recorded ``lemonkit serve`` (the one on the default port first), if it answers."""
    record = server_records.find(DEFAULT_PORT)
    if record is None:
        return None
    server = Server(api_root(record.url), record.key or token, "standalone")
    return server if _answers(server) else None


# -- the Jupyter server of this kernel ----------------------------------------------------------------------------


def _kernel_id() -> str | None:
    """This kernel's id, from its connection file's name; ``None`` outside a kernel."""
    if "ipykernel" not in sys.modules:  # never import it: outside a kernel it is only cost
        return None
    try:
        from ipykernel.connect import get_connection_file

        name = Path(get_connection_file()).name
    except Exception:
        return None
    match = re.fullmatch(r"kernel-(.+)\.json", name)
    return match.group(1) if match else None


def _jupyter_server() -> Server | None:
    """The Jupyter server that started this kernel, when it runs the lemonkit extension."""
    kernel = _kernel_id()
    if kernel is None:
        return None
    from jupyter_server.serverapp import list_running_servers

    parent = os.environ.get("JPY_PARENT_PID")
    hub_token = os.environ.get("JUPYTERHUB_API_TOKEN")
    for info in list_running_servers():
        token = info.get("token") or hub_token
        base = info["url"].rstrip("/") + "/"
        if str(info.get("pid")) != parent and not _owns_kernel(base, token, kernel):
            continue
        server = Server(base + "lemonkit/api/v1", token, "jupyter")
        if _answers(server):
            return server
        warnings.warn(
            f"The Jupyter server at {base} runs this kernel but not the lemonkit extension "
            "(`jupyter server extension enable lemonkit`); using a standalone server instead",
            stacklevel=4,
        )
        return None
    return None


def _owns_kernel(base: str, token: str | None, kernel: str) -> bool:
    headers = {"Authorization": f"token {token}"} if token else {}
    try:
        response = httpx.get(f"{base}api/kernels/{kernel}", headers=headers, timeout=_PROBE_TIMEOUT)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


# -- the embedded server ------------------------------------------------------------------------------------------

_embedded_lock = threading.Lock()
_embedded_server: Server | None = None
_embedded_process: subprocess.Popen[str] | None = None


def _embedded() -> Server:
    """This process's embedded standalone server, started on first use."""
    global _embedded_server, _embedded_process
    with _embedded_lock:
        if _embedded_server is not None and _embedded_process is not None and _embedded_process.poll() is None:
            return _embedded_server
        key = secrets.token_urlsafe(24)  # the port is open to every local user: only this process gets the key
        process = subprocess.Popen(
            [sys.executable, "-m", "lemonkit.cli", "serve", "--embedded", "--port", "0", "--log-level", "warning"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "LEMONADE_API_KEY": key},
        )
        port = _announced_port(process)
        _embedded_process = process
        _embedded_server = Server(f"http://127.0.0.1:{port}/api/v1", key, "embedded")
        atexit.register(_stop_embedded, process, os.getpid())
        return _embedded_server


def _announced_port(process: subprocess.Popen[str]) -> int:
    """The port the embedded server prints once it listens."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        ready = selector.select(_START_TIMEOUT)
    line = process.stdout.readline() if ready else ""
    try:
        return int(json.loads(line)["port"])
    except (ValueError, KeyError, TypeError):
        _stop_embedded(process)
        raise ServerUnavailable(
            f"The embedded lemonkit server did not start (exit status {process.poll()}); its errors are above"
        ) from None


def _stop_embedded(process: subprocess.Popen[str], owner: int | None = None) -> None:
    """Close its stdin (it unloads its models and exits), then make sure it is gone; a forked child of the
    owner leaves it alone."""
    if owner is not None and os.getpid() != owner:
        return
    if process.stdin is not None and not process.stdin.closed:
        process.stdin.close()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- requests and answers ----------------------------------------------------------------------------------------


def _result(response: httpx.Response, raw: bool = False) -> Any:
    if response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            body = None
        exc = error_from_body(response.status_code, body, response.text)
        if isinstance(exc, RetryLater) and response.headers.get("Retry-After", "").isdigit():
            exc.retry_after = float(response.headers["Retry-After"])  # the server's estimate, for a caller's retry
        raise exc
    if raw:
        return response.content
    try:
        return response.json()
    except ValueError:
        raise LemonkitError(
            f"{response.url} answered {response.status_code} with something that is not JSON: is it a lemonkit server?",
            status=502,
            code="invalid_response",
        ) from None


def _event(sse: ServerSentEvent) -> Event | None:
    """One server-sent event as an :class:`Event`; ``None`` for the closing ``[DONE]``.

    Raises:
        LemonkitError: A plain ``data:`` event carrying ``{"error": {...}}`` (a stream that failed after it
            started), as its class.
    """
    if sse.data == "[DONE]":
        return None
    event = Event(sse.event, json.loads(sse.data))
    if sse.event == "message" and isinstance(event.data, dict) and isinstance(event.data.get("error"), dict):
        raise error_from_body(None, event.data)
    return event


def pull_body(
    model: str,
    *,
    variants: dict[str, Any] | None = None,
    variant: str | None = None,
    checkpoint: str | None = None,
    recipe: str = "llamacpp",
    mmproj: str | None = None,
    flags: dict[str, bool] | None = None,
    remote_url: str | None = None,
    remote_urls: list[str] | None = None,
    api_key_env: str | None = None,
) -> dict[str, Any]:
    """The streaming ``/v1/pull`` body for ``model``.

    Args:
        model: A registered name, ``user.<name>`` (with ``checkpoint``) or ``owner/repo``.
        variants: For ``owner/repo``, the hub's ``/v1/pull/variants`` answer: the model registers as
            ``user.<suggested name>`` with the suggested labels and projector.
        variant: The variant of ``owner/repo`` (default: the top one).
        checkpoint: Register ``model`` on this ``repo:variant``.
        recipe: The recipe of a registration.
        mmproj: The vision projector of a registration.
        flags: ``reasoning``/``vision``/``embedding``/``reranking`` of a registration.
        remote_url: A ``remote`` registration's upstream OpenAI base URL (``http://host:8000/v1``).
        remote_urls: Several upstreams of one ``remote`` model (balanced, with failover).
        api_key_env: The server's environment variable (or secrets file entry) holding the upstream's key.

    Raises:
        InvalidArgument: ``owner/repo`` has no variant to pick.
    """
    flags = {k: v for k, v in (flags or {}).items() if v}
    body: dict[str, Any] = {"model_name": model, "stream": True}
    remote = {"remote_url": remote_url, "remote_urls": remote_urls, "api_key_env": api_key_env}
    if any(v is not None for v in remote.values()):
        body.update({k: v for k, v in remote.items() if v is not None}, recipe="remote")
    if checkpoint:
        body.setdefault("recipe", recipe)
        return {**body, "checkpoint": checkpoint, **({"mmproj": mmproj} if mmproj else {}), **flags}
    if variants is None:
        return body
    if not variant:
        if not variants["variants"]:
            raise InvalidArgument(f"{variants['checkpoint']} has no GGUF variant; name one as {model}:<file>")
        variant = variants["variants"][0]["name"]
    labels = variants["suggested_labels"]
    body.update(
        model_name=f"user.{variants['suggested_name']}",
        checkpoint=f"{variants['checkpoint']}:{variant}",
        recipe=variants["recipe"],
    )
    for flag, label in (("vision", "vision"), ("embedding", "embeddings"), ("reranking", "reranking")):
        if label in labels:
            body[flag] = True
    if "vision" in labels and variants["mmproj_files"]:
        body["mmproj"] = variants["mmproj_files"][0]
    return {**body, **flags}


def _split_repo(model: str) -> tuple[str, str | None] | None:
    """``owner/repo[:variant]`` -> ``(repo, variant)``; ``None`` for a model name."""
    if "/" not in model:
        return None
    repo, _, variant = model.partition(":")
    return repo, variant or None


class _Base:
    def __init__(self, url: str | None, token: str | None, start: bool) -> None:
        if url is not None:
            self._server: Server | None = Server(api_root(url), token, "url")
        else:
            self._server = None
        self._start = start

    def _located(self) -> Server:
        if self._server is None:
            self._server = locate(start=self._start)
        return self._server


class Client(_Base, SyncMethods, SyncAudioMethods, SyncImageMethods):
    """A synchronous client of one lemonkit server.

    Besides the management calls here, it has the Python API's methods (``chat``, ``complete``, ``structured``,
    ``embed``, ``rerank``, ``models``, ``stats``: see :class:`lemonkit.chat_methods.SyncMethods`; ``transcribe``,
    ``align``, ``speak``, ``voices``: see :class:`lemonkit.audio_methods.SyncAudioMethods`; ``generate_image``,
    ``edit_image``, ``vary_image``, ``upscale``: see :class:`lemonkit.image_methods.SyncImageMethods`), which the module
    functions (``lemonkit.chat``, ...) call on :func:`lemonkit.default_client`.

    Args:
        url: The server (see :func:`api_root`); default: found at the first request (see the module doc).
        token: Its key or Jupyter token (with ``url``).
        start: Start the embedded server when no server is found.

    Raises:
        ServerUnavailable: From any request, when no server can be reached.
    """

    def __init__(self, url: str | None = None, *, token: str | None = None, start: bool = True) -> None:
        super().__init__(url, token, start)
        self._http: httpx.Client | None = None

    @property
    def server(self) -> Server:
        """The server this client talks to (found now if it was not yet)."""
        return self._located()

    def _client(self) -> httpx.Client:
        if self._http is None:
            server = self._located()
            self._http = httpx.Client(base_url=server.api + "/", headers=server.headers, timeout=_TIMEOUT)
        return self._http

    def request(
        self, method: str, path: str, *, headers_out: dict[str, str] | None = None, raw: bool = False, **kwargs: Any
    ) -> Any:
        """One request; returns the JSON answer, or with ``raw`` its bytes (and fills ``headers_out`` with the
        answer's headers).

        Raises:
            LemonkitError: The server's error, as its class (by ``code``).
            ServerUnavailable: The server cannot be reached.
        """
        try:
            response = self._client().request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"lemonkit server at {self._located().api} unreachable: {exc}") from exc
        if headers_out is not None:
            headers_out.update(response.headers)
        return _result(response, raw)

    def events(self, path: str, body: dict[str, Any], *, headers_out: dict[str, str] | None = None) -> Iterator[Event]:
        """POST ``body`` and yield the server-sent events of the answer, up to ``[DONE]`` or the end (filling
        ``headers_out`` with the answer's headers once they arrive)."""
        try:
            with self._client().stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    _result(response)
                if headers_out is not None:
                    headers_out.update(response.headers)
                for sse in EventSource(response).iter_sse():
                    event = _event(sse)
                    if event is None:
                        return
                    yield event
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"lemonkit server at {self._located().api} unreachable: {exc}") from exc

    def health(self) -> dict[str, Any]:
        """The server's ``/v1/health``: version, loaded models (``all_models_loaded``: name, type, pid, options).

        Raises:
            ServerUnavailable: No server could be reached or started.

        Example:
            >>> lemonkit.Client().health()["model_loaded"]
        """
        return self.request("GET", "health")

    def model(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"models/{name}")

    def variants(self, checkpoint: str) -> dict[str, Any]:
        """The GGUF variants of a hub repo (``GET /v1/pull/variants``)."""
        return self.request("GET", "pull/variants", params={"checkpoint": checkpoint})

    def pull_request(self, model: str, **registration: Any) -> dict[str, Any]:
        """The ``/v1/pull`` body for ``model`` (see :func:`pull_body`), asking the hub about an ``owner/repo``."""
        repo = _split_repo(model) if not registration.get("checkpoint") else None
        info = self.variants(repo[0]) if repo else None
        return pull_body(model, variants=info, variant=repo[1] if repo else None, **registration)

    def pull(self, model: str, **registration: Any) -> Iterator[Event]:
        """Pull ``model`` (see :func:`pull_body` for ``model`` and ``registration``); yields the SSE
        ``progress``/``complete``/``error`` events. Leaving the iteration early pauses the download."""
        yield from self.events("pull", self.pull_request(model, **registration))

    def load(self, name: str, **options: Any) -> dict[str, Any]:
        """Load a model (downloading it first if needed).

        Args:
            name: The model.
            **options: ``/v1/load`` options: ``ctx_size``, ``llamacpp_args``, ``pinned``, ``save_options``, ...

        Returns:
            The server's answer (``{"status": "success", "message": ...}``).

        Raises:
            ModelNotFound: ``name`` is not registered.
            ModelLoadError: The engine failed to load it.

        Example:
            >>> lemonkit.Client().load("Gemma-3-270m-GGUF", ctx_size=4096)
        """
        return self.request("POST", "load", json={"model_name": name, **options})

    def unload(self, name: str | None = None) -> dict[str, Any]:
        """Unload a model, or every model (its process exits and gives its memory back).

        Args:
            name: The model; ``None``: all of them.

        Returns:
            The server's answer.

        Raises:
            ModelNotFound: ``name`` is not loaded.

        Example:
            >>> lemonkit.Client().unload()
        """
        return self.request("POST", "unload", json={"model_name": name} if name else {})

    def delete(self, name: str) -> dict[str, Any]:
        return self.request("POST", "delete", json={"model_name": name})

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base, AsyncMethods, AsyncAudioMethods, AsyncImageMethods):
    """The asynchronous twin of :class:`Client` (same arguments, same methods, awaitable)."""

    def __init__(self, url: str | None = None, *, token: str | None = None, start: bool = True) -> None:
        super().__init__(url, token, start)
        self._http: httpx.AsyncClient | None = None

    async def server(self) -> Server:
        if self._server is None:
            import asyncio

            self._server = await asyncio.to_thread(locate, start=self._start)
        return self._server

    async def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            server = await self.server()
            self._http = httpx.AsyncClient(base_url=server.api + "/", headers=server.headers, timeout=_TIMEOUT)
        return self._http

    async def request(
        self, method: str, path: str, *, headers_out: dict[str, str] | None = None, raw: bool = False, **kwargs: Any
    ) -> Any:
        client = await self._client()
        try:
            response = await client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"lemonkit server at {client.base_url} unreachable: {exc}") from exc
        if headers_out is not None:
            headers_out.update(response.headers)
        return _result(response, raw)

    async def events(
        self, path: str, body: dict[str, Any], *, headers_out: dict[str, str] | None = None
    ) -> AsyncIterator[Event]:
        client = await self._client()
        try:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _result(response)
                if headers_out is not None:
                    headers_out.update(response.headers)
                async for sse in EventSource(response).aiter_sse():
                    event = _event(sse)
                    if event is None:
                        return
                    yield event
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"lemonkit server at {client.base_url} unreachable: {exc}") from exc

    async def health(self) -> dict[str, Any]:
        return await self.request("GET", "health")

    async def model(self, name: str) -> dict[str, Any]:
        return await self.request("GET", f"models/{name}")

    async def variants(self, checkpoint: str) -> dict[str, Any]:
        return await self.request("GET", "pull/variants", params={"checkpoint": checkpoint})

    async def pull_request(self, model: str, **registration: Any) -> dict[str, Any]:
        repo = _split_repo(model) if not registration.get("checkpoint") else None
        info = await self.variants(repo[0]) if repo else None
        return pull_body(model, variants=info, variant=repo[1] if repo else None, **registration)

    async def pull(self, model: str, **registration: Any) -> AsyncIterator[Event]:
        async for event in self.events("pull", await self.pull_request(model, **registration)):
            yield event

    async def load(self, name: str, **options: Any) -> dict[str, Any]:
        return await self.request("POST", "load", json={"model_name": name, **options})

    async def unload(self, name: str | None = None) -> dict[str, Any]:
        return await self.request("POST", "unload", json={"model_name": name} if name else {})

    async def delete(self, name: str) -> dict[str, Any]:
        return await self.request("POST", "delete", json={"model_name": name})

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_default_lock = threading.Lock()
_default: Client | None = None


def default_client() -> Client:
    """The client the module-level functions use (``lemonkit.chat()``...): one per process, made at the first
    call; it finds (or starts) its server at its first request."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default
