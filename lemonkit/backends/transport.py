"""The front's end of a sidecar's Unix socket: an ``httpx.AsyncClient`` on asyncio streams.

httpx's default network backend (anyio) waits for readability with add_reader/remove_reader around every recv,
under a cancel scope: per streamed token that is two epoll_ctl calls and a scope the front pays for. An asyncio
stream keeps the socket registered and hands over whatever arrived; httpcore and h11 still do all of HTTP, and
errors are httpx's own, so callers see the same client as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpcore
import httpx

__all__ = ["connect"]


class _UnixStream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            if timeout is None:
                return await self._reader.read(max_bytes)
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout("timed out reading from the sidecar") from None
        except OSError as exc:
            raise httpcore.ReadError(str(exc) or type(exc).__name__) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            self._writer.write(buffer)
            async with asyncio.timeout(timeout):
                await self._writer.drain()
        except TimeoutError:
            raise httpcore.WriteTimeout("timed out writing to the sidecar") from None
        except (OSError, RuntimeError) as exc:  # RuntimeError: the transport is already closed
            raise httpcore.WriteError(str(exc) or type(exc).__name__) from exc

    async def aclose(self) -> None:
        self._writer.close()

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # an idle connection with something to read was closed by the sidecar
            return self._reader.at_eof() or self._writer.transport.is_closing()
        if info in ("socket", "client_addr", "server_addr"):
            sock = self._writer.get_extra_info("socket")
            if info == "socket":
                return sock
            return None if sock is None else sock.getsockname() if info == "client_addr" else sock.getpeername()
        return None


class _UnixBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("a sidecar is reached over its Unix socket only")

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"timed out connecting to {path}") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc) or type(exc).__name__) from exc
        return _UnixStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _as_httpx(exc: httpcore.TimeoutException | httpcore.NetworkError | httpcore.ProtocolError) -> httpx.HTTPError:
    mapped: type[httpx.HTTPError] = getattr(httpx, type(exc).__name__, httpx.TransportError)
    return mapped(str(exc))


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for part in self._stream:
                yield part
        except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise _as_httpx(exc) from exc

    async def aclose(self) -> None:
        await self._stream.aclose()


class _Transport(httpx.AsyncBaseTransport):
    def __init__(self, socket_path: str) -> None:
        limits = httpx.Limits()  # httpx's own defaults, as its default transport would use
        self._pool = httpcore.AsyncConnectionPool(
            uds=socket_path,
            network_backend=_UnixBackend(),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        try:
            response = await self._pool.handle_async_request(core)
        except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise _as_httpx(exc) from exc
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()


def connect(socket_path: str) -> httpx.AsyncClient:
    """An HTTP client for the sidecar listening on ``socket_path`` (requests go to ``http://sidecar/...``)."""
    return httpx.AsyncClient(
        transport=_Transport(socket_path), base_url="http://sidecar", timeout=httpx.Timeout(None, connect=10.0)
    )
