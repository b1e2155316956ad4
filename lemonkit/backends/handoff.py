"""Handing a client's connection to the sidecar, so a stream's events go straight from the engine to the client.

Relaying every event through the front costs it about 300 µs of Python per token, which on a small machine comes
out of decoding. So once the front has authenticated and admitted a streaming request, sent it to the sidecar and
had a 200 back, it writes the response's headers itself and passes the client's socket to the sidecar
(``SCM_RIGHTS`` over a second Unix socket beside the sidecar's own). The engine's thread writes the SSE body to the
client in HTTP/1.1 chunks (:class:`Sink`), and the sidecar, when the stream ends or the client leaves, ends its HTTP
answer to the front with one JSON line saying which. The front holds the model until then, as it would for a
relayed stream, and the connection closes with the stream. Should the sidecar die meanwhile, the front still holds
its copy of the socket and ends the stream with an error event.

The front asks with the ``X-Lemonkit-Handoff`` request header only when it can hand the connection over (plain HTTP/1.1,
no TLS, no compression); the sidecar agrees by answering with the same header naming a token, and the socket it
then receives is matched to the waiting answer by that token.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time

__all__ = ["LAST_CHUNK", "Handoffs", "Sink", "chunk", "hand_over", "path_for"]

#: the request header asking the sidecar to take the client's connection, and the answer's header naming a token
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

    def __init__(self, listener: socket.socket) -> None:
        """``listener``: a Unix socket listening at :func:`path_for` the sidecar's socket (0600, as that one is)."""
        listener.setblocking(False)
        self._listener = listener
        self._waiting: dict[str, asyncio.Future[socket.socket]] = {}
        self._receiving: set[asyncio.Task[None]] = set()

    async def serve(self) -> None:
        """Accept hand-overs until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            channel, _ = await loop.sock_accept(self._listener)
            task = loop.create_task(self._receive(channel))
            self._receiving.add(task)
            task.add_done_callback(self._receiving.discard)

    async def _receive(self, channel: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with channel:
            readable: asyncio.Future[None] = loop.create_future()

            def ready() -> None:
                if not readable.done():
                    readable.set_result(None)

            loop.add_reader(channel, ready)
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


class Sink:
    """Where the engine's thread writes a stream's SSE frames itself: straight into the client's connection once the
    front has handed it over, with no hop through the event loop per token. Frames made before that wait here.

    ``cancel`` is set when the client is found gone (a write fails, or :meth:`left` is told).
    """

    def __init__(self, cancel: threading.Event) -> None:
        self._lock = threading.Lock()
        self._connection: socket.socket | None = None
        self._pending: list[bytes] = []
        self._cancel = cancel
        #: the client left: nothing more is written
        self.gone = False
        #: when a frame last went out (``time.monotonic()``): pings fill long silences
        self.last = time.monotonic()

    def write(self, frame: bytes) -> None:
        """Send one frame (engine thread); blocks while the client's buffers are full."""
        if not frame:  # an empty chunk would end the body
            return
        with self._lock:
            if self._connection is None:
                self._pending.append(frame)
            else:
                self._send(chunk(frame))

    def attach(self, connection: socket.socket) -> None:
        """Take the client's connection (blocking) and send what waited for it; may block, so not on the loop."""
        connection.setblocking(True)
        with self._lock:
            self._connection = connection
            waiting, self._pending = self._pending, []
            if waiting:
                self._send(b"".join(chunk(frame) for frame in waiting))

    def ping(self, quiet: float) -> None:
        """Send a comment frame if nothing went out for ``quiet`` seconds (keeps proxies from timing out)."""
        with self._lock:
            if self._connection is not None and time.monotonic() - self.last >= quiet:
                self._send(chunk(b": ping\n\n"))

    def end(self) -> None:
        """Send the last chunk: the response is complete."""
        with self._lock:
            if self._connection is not None:
                self._send(LAST_CHUNK)

    def left(self) -> None:
        """The client closed its end: stop."""
        self.gone = True
        self._cancel.set()

    def _send(self, data: bytes) -> None:
        if self.gone or self._connection is None:
            return
        try:
            self._connection.sendall(data)
        except OSError:
            self.left()
            return
        self.last = time.monotonic()
