"""Handing a client's connection to the sidecar, so a stream's events go straight from the engine to the client.

Relaying every event through the front costs it about 300 µs of Python per token, which on a small machine comes
out of decoding. So once the front has authenticated and admitted a streaming request, sent it to the sidecar and
had a 200 back, it writes the response's headers itself and passes the client's socket to the sidecar
(``SCM_RIGHTS`` over a second Unix socket beside the sidecar's own). The sidecar writes the SSE body to the client
in HTTP/1.1 chunks and, when the stream ends or the client leaves, ends its HTTP answer to the front with one JSON
line saying which. The front holds the model until then, as it would for a relayed stream.

The front asks with the :data:`HEADER` request header only when it can hand the connection over (plain HTTP/1.1,
no TLS, no compression); the sidecar agrees by answering with the same header naming a token, and the socket it
then receives is matched to the waiting answer by that token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable

__all__ = ["HEADER", "LAST_CHUNK", "Handoffs", "chunk", "hand_over", "path_for", "write_stream"]

#: the request header asking the sidecar to take the client's connection, and the answer's header naming a token
HEADER = "X-Lemonkit-Handoff"
#: how long an answer waits for the socket the front promised before it gives up
WAIT = 10.0
#: the chunk that ends a chunked body
LAST_CHUNK = b"0\r\n\r\n"


def path_for(socket_path: str) -> str:
    """The Unix socket, beside a sidecar's ``socket_path``, on which it receives client connections."""
    return socket_path + ".fd"


def chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


async def hand_over(path: str, token: str, connection: socket.socket) -> None:
    """Pass ``connection`` to the sidecar listening on ``path``, for the answer that named ``token``.

    Raises:
        OSError: The sidecar is not listening.
    """
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        channel.setblocking(False)
        await loop.sock_connect(channel, path)
        # a fresh connection's buffer takes a token and a descriptor at once
        socket.send_fds(channel, [token.encode()], [connection.fileno()])


class Handoffs:
    """The sidecar's end: a listener receiving client connections, and the answers waiting for them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._waiting: dict[str, asyncio.Future[socket.socket]] = {}
        self._listener: socket.socket | None = None
        self._receiving: set[asyncio.Task[None]] = set()

    def listen(self) -> None:
        """Create the listening socket (0600, like the sidecar's own)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(self.path)
        finally:
            os.umask(old_umask)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener

    async def serve(self) -> None:
        """Accept hand-overs until cancelled."""
        assert self._listener is not None, "listen() first"
        loop = asyncio.get_running_loop()
        while True:
            channel, _ = await loop.sock_accept(self._listener)
            task = loop.create_task(self._receive(channel))
            self._receiving.add(task)
            task.add_done_callback(self._receiving.discard)

    async def _receive(self, channel: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with channel:
            readable = loop.create_future()
            loop.add_reader(channel, readable.set_result, None)
            try:
                async with asyncio.timeout(WAIT):
                    await readable
            except TimeoutError:
                return
            finally:
                loop.remove_reader(channel)
            try:
                data, fds, _, _ = socket.recv_fds(channel, 256, 1)
            except OSError:
                return
        connections = [socket.socket(fileno=fd) for fd in fds]
        waiting = self._waiting.pop(data.decode(errors="replace"), None)
        if waiting is None or waiting.done() or len(connections) != 1:
            for connection in connections:
                connection.close()
            return
        waiting.set_result(connections[0])

    def expect(self) -> tuple[str, asyncio.Future[socket.socket]]:
        """A token to name in an answer, and the future the connection handed over for it resolves."""
        token = secrets.token_urlsafe(16)
        future: asyncio.Future[socket.socket] = asyncio.get_running_loop().create_future()
        self._waiting[token] = future
        future.add_done_callback(lambda _: self._waiting.pop(token, None))
        return token, future


async def write_stream(
    connection: asyncio.Future[socket.socket], frames: AsyncIterator[bytes], *, stop: Callable[[], None]
) -> AsyncIterator[bytes]:
    """Write ``frames`` to the client connection the front hands over, then answer the front with how it ended.

    The stream ends early when the client leaves (its end of the connection closes). When the front leaves, the
    app cancels this answer. However it ends, ``stop`` is called (it stops the engine) and ``frames`` is closed.
    Yields the one JSON line of the front's answer: ``{"ended": "done" | "client" | "no connection"}``.
    """
    try:
        try:
            async with asyncio.timeout(WAIT):
                client = await connection
        except TimeoutError:
            yield b'{"ended": "no connection"}\n'
            return
        reader, writer = await asyncio.open_connection(sock=client)
        client_gone = asyncio.ensure_future(_until_eof(reader))

        async def write() -> None:
            async for frame in frames:
                if frame:  # an empty chunk would end the body
                    writer.write(chunk(frame))
                    await writer.drain()
            writer.write(LAST_CHUNK)
            await writer.drain()

        writing = asyncio.ensure_future(write())
        try:
            await asyncio.wait([writing, client_gone], return_when=asyncio.FIRST_COMPLETED)
            ended = "done" if writing.done() and writing.exception() is None else "client"
        finally:
            for task in (writing, client_gone):
                task.cancel()
            await asyncio.gather(writing, client_gone, return_exceptions=True)
            writer.close()
        yield json.dumps({"ended": ended}).encode() + b"\n"
    finally:
        stop()
        await _close(frames)


async def _until_eof(reader: asyncio.StreamReader) -> None:
    """Return when the client closes its end (anything it sends meanwhile, it sends to a closing connection)."""
    while await reader.read(65536):
        pass


async def _close(frames: AsyncIterator[bytes]) -> None:
    aclose = getattr(frames, "aclose", None)
    if aclose is not None:
        await aclose()
