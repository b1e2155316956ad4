"""How Python code reaches a lemonkit server: :class:`Client` and :class:`AsyncClient` (httpx).

The Python API, the widgets and the ``lemonkit`` management commands talk to a server only through these. A client
built without a URL finds its server at the first request (:func:`~lemonkit.client.discovery.locate` gives the
order: ``LEMONKIT_URL``, the JupyterHub's service, this kernel's Jupyter server, a recorded ``lemonkit serve``, else
an embedded server). Every call is written once, as steps (:mod:`lemonkit.client.calls`): the two clients differ
only in how they perform a step, one blocking and one awaiting.

Errors come back as the server's own exception classes (:mod:`lemonkit.errors`), found by the answer's ``code``,
so ``except lemonkit.ModelNotFound`` works on either side of the wire; a server that cannot be reached raises
:class:`ServerUnavailable`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent

from lemonkit.client.audio_calls import AudioCalls
from lemonkit.client.calls import Awaiting, Blocking, Request, Step, Stream
from lemonkit.client.chat_calls import ChatCalls
from lemonkit.client.discovery import Server, api_root, locate
from lemonkit.client.image_calls import ImageCalls
from lemonkit.client.model_calls import ModelCalls
from lemonkit.errors import LemonkitError, RetryLater, ServerUnavailable, error_from_body

__all__ = ["AsyncClient", "Client", "Event", "Server", "ServerUnavailable", "default_client", "locate"]

_TIMEOUT = httpx.Timeout(60.0, read=None)  # streams (pulls, generations) may be silent for long


@dataclass(frozen=True)
class Event:
    """One server-sent event: ``name`` is its ``event:`` line (``"message"`` without one)."""

    name: str
    data: Any


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


class _Base(ModelCalls, ChatCalls, AudioCalls, ImageCalls):
    def __init__(self, url: str | None, token: str | None, start: bool) -> None:
        self._server: Server | None = Server(api_root(url), token, "url") if url is not None else None
        self._start = start


def _unreachable(server: Server, exc: Exception) -> ServerUnavailable:
    return ServerUnavailable(f"lemonkit server at {server.api} unreachable: {exc}")


class Client(_Base, Blocking):
    """A synchronous client of one lemonkit server.

    Its calls (``health``, ``pull``, ``load``, ``unload``, ``delete``:
    :class:`~lemonkit.client.model_calls.ModelCalls`; ``chat``, ``complete``, ``structured``, ``embed``,
    ``rerank``, ``models``, ``stats``: :class:`~lemonkit.client.chat_calls.ChatCalls`; ``transcribe``, ``align``,
    ``speak``, ``voice_chat``,
    ``voices``: :class:`~lemonkit.client.audio_calls.AudioCalls`; ``generate_image``, ``edit_image``,
    ``vary_image``, ``upscale``: :class:`~lemonkit.client.image_calls.ImageCalls`) are the module functions'
    (``lemonkit.chat``, ...), which run them on :func:`lemonkit.default_client`.

    Args:
        url: The server (see :func:`~lemonkit.client.discovery.api_root`); default: found at the first request.
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
        if self._server is None:
            self._server = locate(start=self._start)
        return self._server

    def _client(self) -> httpx.Client:
        if self._http is None:
            server = self.server
            self._http = httpx.Client(base_url=server.api + "/", headers=server.headers, timeout=_TIMEOUT)
        return self._http

    def _perform(self, step: Step) -> Any:
        if isinstance(step, Request):
            return self.request(step.method, step.path, headers_out=step.headers_out, raw=step.raw, **step.kwargs)
        if isinstance(step, Stream):
            for event in self.events(step.path, step.body, headers_out=step.headers_out):
                step.on_event(event)
            return None
        return self.server

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
            raise _unreachable(self.server, exc) from exc
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
                    if (event := _event(sse)) is None:
                        return
                    yield event
        except httpx.TransportError as exc:
            raise _unreachable(self.server, exc) from exc

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base, Awaiting):
    """The asynchronous twin of :class:`Client`: the same calls, each a coroutine (``pull`` an async iterator)."""

    def __init__(self, url: str | None = None, *, token: str | None = None, start: bool = True) -> None:
        super().__init__(url, token, start)
        self._http: httpx.AsyncClient | None = None

    async def server(self) -> Server:
        """The server this client talks to (found now, in a thread, if it was not yet)."""
        if self._server is None:
            self._server = await asyncio.to_thread(locate, start=self._start)
        return self._server

    async def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            server = await self.server()
            self._http = httpx.AsyncClient(base_url=server.api + "/", headers=server.headers, timeout=_TIMEOUT)
        return self._http

    async def _perform(self, step: Step) -> Any:
        if isinstance(step, Request):
            return await self.request(step.method, step.path, headers_out=step.headers_out, raw=step.raw, **step.kwargs)
        if isinstance(step, Stream):
            async for event in self.events(step.path, step.body, headers_out=step.headers_out):
                step.on_event(event)
            return None
        return await self.server()

    async def request(
        self, method: str, path: str, *, headers_out: dict[str, str] | None = None, raw: bool = False, **kwargs: Any
    ) -> Any:
        """:meth:`Client.request`, awaited."""
        client = await self._client()
        try:
            response = await client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _unreachable(await self.server(), exc) from exc
        if headers_out is not None:
            headers_out.update(response.headers)
        return _result(response, raw)

    async def events(
        self, path: str, body: dict[str, Any], *, headers_out: dict[str, str] | None = None
    ) -> AsyncIterator[Event]:
        """:meth:`Client.events`, as an async iterator."""
        client = await self._client()
        try:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _result(response)
                if headers_out is not None:
                    headers_out.update(response.headers)
                async for sse in EventSource(response).aiter_sse():
                    if (event := _event(sse)) is None:
                        return
                    yield event
        except httpx.TransportError as exc:
            raise _unreachable(await self.server(), exc) from exc

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
