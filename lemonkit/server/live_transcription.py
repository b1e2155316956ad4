"""``POST /v1/audio/transcriptions/live``: raw PCM in a chunked body, transcript deltas on the same connection
while the body is still arriving (spec: audio-api.md, "Live PCM transcription").

Tornado's own body reader cannot keep the spec's promises: it never shows a chunk's declared size (so
``max_chunk_bytes`` cannot be checked before the chunk is read), it answers a malformed frame with a bare
``400`` written into the middle of the response, and its IOStream closes the whole socket as soon as it reads the
end of the client's half of the connection, so a client that half-closes after a truncated body would get
nothing back. So the handler does the work in ``prepare`` (which Tornado runs for a streamed body before reading
any of it), and takes the connection over (``detach()``): it reads the chunked framing itself from the IOStream,
and writes the whole answer itself, through a duplicate of the socket's descriptor taken before anything was
awaited, which stays open when the IOStream closes its own. Requests refused before the stream starts
(credentials, parameters, the model) get JSON errors with their status; after that, a truncated body, a stall, an
oversized chunk or body and a malformed frame each end the stream with an SSE ``error`` event (then the answer's
last chunk), never ``transcript.text.done``. Either way the server reads what the client still sends for a moment
before closing, so that unread input does not reset the connection and take the answer with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tornado import httputil, iostream, web

from lemonkit.catalog.config import LiveLimits
from lemonkit.catalog.model_info import a_model_of
from lemonkit.errors import (
    BodyError,
    InvalidArgument,
    InvalidRequest,
    LemonkitError,
    MissingArgument,
    ModelNotApplicable,
)
from lemonkit.formats import sse
from lemonkit.formats.audio_codec import WHISPER_RATE, from_pcm
from lemonkit.formats.vad import VadSettings
from lemonkit.server.handler import SSE_HEADERS, LemonkitHandler, as_lemonkit_error, error_event
from lemonkit.server.utterance import SidecarTranscriber, SpeechInput, StableText

__all__ = ["LiveTranscriptionHandler"]

log = logging.getLogger("lemonkit.server")

#: the most of a chunk read at once (a chunk may be declared up to max_chunk_bytes)
_PIECE = 64 * 1024
#: seconds the input is still drained after an early answer, so that closing does not reset the connection
#: (and take the unread answer with it) while the client is still sending
_LINGER = 2.0
_SAMPLE_BYTES = {"s16le": 2, "f32le": 4}


def _truncated() -> BodyError:
    return BodyError(
        "The request body ended without its terminating chunk: the audio may be cut short, so no transcript is final",
        status=400,
        code="truncated_body",
    )


@dataclass(frozen=True)
class LiveParams:
    """The query parameters of a live request."""

    model: str
    sample_rate: int = 16000
    channels: int = 1
    sample_format: str = "s16le"
    language: str | None = None
    prompt: str | None = None

    @classmethod
    def parse(cls, handler: web.RequestHandler) -> LiveParams:
        """Raises:
        MissingArgument, InvalidArgument: A parameter is missing or out of range.
        """
        model = handler.get_query_argument("model", "").strip()
        if not model:
            raise MissingArgument("model: required (a query parameter: the body is the audio)")
        fmt = handler.get_query_argument("sample_format", "s16le")
        if fmt not in _SAMPLE_BYTES:
            raise InvalidArgument(f"sample_format: s16le or f32le, not {fmt!r}")
        return cls(
            model=model,
            sample_rate=_int_param(handler, "sample_rate", 16000, 1000, 384000),
            channels=_int_param(handler, "channels", 1, 1, 16),
            sample_format=fmt,
            language=handler.get_query_argument("language", None) or None,
            prompt=handler.get_query_argument("prompt", None) or None,
        )

    @property
    def frame_bytes(self) -> int:
        return _SAMPLE_BYTES[self.sample_format] * self.channels


def _int_param(handler: web.RequestHandler, name: str, default: int, low: int, high: int) -> int:
    raw = handler.get_query_argument(name, None)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(f"{name}: an integer from {low} to {high}, not {raw!r}") from None
    if not low <= value <= high:
        raise InvalidArgument(f"{name}: from {low} to {high}, got {value}")
    return value


class ChunkedBody:
    """Reads a chunked request body from an IOStream, one piece at a time, within the live bounds.

    Raises (from :meth:`next`):
        BodyError: The body is truncated, stalls, breaks a size bound or is not valid chunked framing.
    """

    def __init__(self, stream: iostream.IOStream, limits: LiveLimits) -> None:
        self.stream, self.limits = stream, limits
        self._deadline = time.monotonic() + limits.total_timeout_ms / 1000 if limits.total_timeout_ms else None
        self._received = 0
        self._left = 0  # of the current chunk's data
        #: the terminating chunk arrived
        self.complete = False

    async def next(self) -> bytes | None:
        """The next piece of chunk data; ``None`` once the terminating chunk (and trailers) arrived."""
        if self._left == 0:
            size = await self._chunk_size()
            if size == 0:
                while await self._line() != b"\r\n":  # trailers, ignored
                    pass
                self.complete = True
                return None
            self._left = size
        data = await self._read(lambda: self.stream.read_bytes(min(self._left, _PIECE), partial=True))
        self._left -= len(data)
        if self._left == 0 and await self._read(lambda: self.stream.read_bytes(2)) != b"\r\n":
            raise BodyError("A chunk of the body is not followed by CRLF", status=400, code="malformed_body")
        return data

    async def _chunk_size(self) -> int:
        line = await self._line()
        text = line[:-2].split(b";", 1)[0].strip()
        try:
            size = int(text, 16) if text and len(text) <= 16 else -1
        except ValueError:
            size = -1
        if size < 0:
            raise BodyError(f"Invalid chunk size line {line[:40]!r}", status=400, code="malformed_body")
        if size > self.limits.max_chunk_bytes:
            raise BodyError(
                f"A chunk of {size} bytes is larger than the server's bound of {self.limits.max_chunk_bytes}",
                status=413,
                code="chunk_too_large",
            )
        self._count(size + 2)
        return size

    async def _line(self) -> bytes:
        try:
            return await self._read(lambda: self.stream.read_until(b"\r\n", max_bytes=1024))
        except iostream.UnsatisfiableReadError:
            raise BodyError("A chunk size line is too long", status=400, code="malformed_body") from None

    def _count(self, size: int) -> None:
        self._received += size
        bound = self.limits.max_body_bytes
        if bound and self._received > bound:
            raise BodyError(
                f"The body is larger than the server's bound of {bound} bytes", status=413, code="body_too_large"
            )

    async def _read(self, start: Callable[[], Awaitable[bytes]]) -> bytes:
        """The result of the IOStream read ``start()`` begins (a closed stream refuses it at once, or later)."""
        idle = self.limits.idle_timeout_ms / 1000 or None
        total = self._deadline - time.monotonic() if self._deadline is not None else None
        wait = min((t for t in (idle, total) if t is not None), default=None)
        try:
            data = await asyncio.wait_for(start(), wait)
        except iostream.StreamClosedError:
            raise _truncated() from None
        except TimeoutError:
            if total is not None and wait == total:
                raise BodyError(
                    f"The body took longer than the server's bound of {self.limits.total_timeout_ms} ms",
                    status=408,
                    code="total_timeout",
                ) from None
            raise BodyError(
                f"No audio arrived for {self.limits.idle_timeout_ms} ms", status=408, code="idle_timeout"
            ) from None
        self._count(len(data))
        return data


class SseOut:
    """Writes the SSE response's chunks through the detached connection's duplicate socket."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)  # it already is (the flag belongs to the socket, shared with the IOStream's)
        self.sock = sock
        self.gone = False

    async def event(self, data: dict[str, Any]) -> None:
        await self.frame(sse.frame(data))

    async def frame(self, data: bytes) -> None:
        await self.raw(b"%x\r\n%b\r\n" % (len(data), data))

    async def raw(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
        except OSError:
            self.gone = True

    async def end(self) -> None:
        """The response's last chunk."""
        await self.raw(b"0\r\n\r\n")


class _Deltas:
    """The live route's :class:`~lemonkit.server.utterance.Listener`: stable text as ``transcript.text.delta``."""

    def __init__(self, out: SseOut) -> None:
        self.out = out
        self.reading: asyncio.Future[None] | None = None  # the body's reader: a failure stops it
        self.text = StableText()
        self.failure: LemonkitError | None = None

    async def interim(self, item: str, text: str) -> None:
        await self._delta(self.text.interim(text))

    async def completed(self, item: str, text: str) -> None:
        await self._delta(self.text.final(text))

    async def failed(self, item: str, error: LemonkitError) -> None:
        if self.failure is None:
            self.failure = error
        self._stop()

    async def _delta(self, delta: str) -> None:
        if delta:
            await self.out.event({"type": "transcript.text.delta", "delta": delta})
        if self.out.gone:
            self._stop()

    def _stop(self) -> None:
        if self.reading is not None:
            self.reading.cancel()

    async def speech_started(self, item: str, ms: int) -> None:
        pass

    async def speech_stopped(self, item: str, ms: int) -> None:
        pass

    async def committed(self, item: str) -> None:
        pass


class LiveTranscriptionHandler(LemonkitHandler):
    """The live route. Everything happens in :meth:`prepare`, where a streamed body's handler runs before Tornado
    reads the body: the checks (JSON errors with their status), then the session on the taken-over connection."""

    # what @tornado.web.stream_request_body sets; the decorator itself only takes a RequestHandler, and this
    # class becomes one when a host joins it to its base
    _stream_request_body = True
    #: the body is not JSON (route-table tests feed JSON only to routes that read it)
    raw_body = True

    def data_received(self, chunk: bytes) -> None:
        """Tornado reads the body only of a request refused before the session took the connection: ignored."""

    async def prepare(self) -> None:
        # the answer goes out through a duplicate of the socket, taken before anything is awaited: the IOStream
        # closes its own descriptor when it reads the client's FIN, which may come while the model loads
        connection: Any = self.request.connection  # an HTTP1Connection: this route needs HTTP/1.1
        sock = connection.stream.socket  # None once the IOStream closed: the client left before we got here
        if sock is None:
            log.info(
                "%s %s: the client closed the connection before the request was read",
                self.request.method,
                self.request.path,
            )
            self.set_status(499, "Client Closed Request")  # nginx's code: the access log says what happened
            raise web.Finish()
        out = SseOut(sock.dup())
        try:
            try:
                checked = super().prepare()  # the host's: credentials, Host and Origin, CORS preflights
                if checked is not None:
                    await checked
                if self._finished or self.request.method != "POST":
                    return
                params = LiveParams.parse(self)
                model = await self._accept(params)
            except (LemonkitError, web.HTTPError) as exc:
                await self._refuse(out, as_lemonkit_error(exc, 500))
                return
            await self._session(out, params, model)
        finally:
            out.sock.close()

    async def _accept(self, params: LiveParams) -> str:
        """The id of the model that will transcribe, loaded.

        Raises:
            LemonkitError: The request cannot be served (the body is not chunked, the model is not one that
                transcribes, it failed to load).
        """
        if "chunked" not in self.request.headers.get("Transfer-Encoding", "").lower():
            raise InvalidRequest(
                "Send the audio as a chunked body (Transfer-Encoding: chunked), as it is captured",
                code="not_chunked",
            )
        info = await self.service.usable(params.model)
        if info.type != "transcription":
            raise ModelNotApplicable(f"{info.id} is {a_model_of(info.type)}; {self.request.path} needs transcription")
        await self.service.manager.warm(info.id)  # loaded now, so that a load failure is answered with its status
        return info.id

    async def post(self) -> None:
        """Never reached: :meth:`prepare` answered, or took the connection over."""

    def _head(self, status: int, headers: dict[str, str]) -> bytes:
        """The response's status line and headers: those the host set (``Access-Control-Allow-Origin``, ...)
        with ``headers`` over them. Written by hand because the IOStream Tornado writes them with may be closed."""
        merged = httputil.HTTPHeaders(self._headers)  # what set_default_headers and the host's checks set
        for name, value in {**headers, "Connection": "close"}.items():
            merged[name] = value
        lines = [f"HTTP/1.1 {status} {httputil.responses.get(status, 'Unknown')}"]
        lines += [f"{name}: {value}" for name, value in merged.get_all()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _refuse(self, out: SseOut, err: LemonkitError) -> None:
        """Answer ``err`` as a JSON error, then read what the client still sends before closing: Tornado would
        close at once, and a connection closed with unread data is reset, losing the answer on its way."""
        log.info("%s %s -> %s %s", self.request.method, self.request.path, err.status, err.message)
        body = json.dumps(err.to_dict()).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        await out.raw(self._head(err.status, headers) + body)
        await self._hang_up(out, self.detach(), drain=True)

    async def _session(self, out: SseOut, params: LiveParams, model: str) -> None:
        head = self._head(200, {**SSE_HEADERS, "Transfer-Encoding": "chunked"})
        if self.request.headers.get("Expect", "").lower() == "100-continue":
            head = b"HTTP/1.1 100 Continue\r\n\r\n" + head
        stream = self.detach()
        await out.raw(head)
        complete = False
        try:
            complete = await self._stream(params, model, stream, out)
        finally:
            await self._hang_up(out, stream, drain=not complete)

    @staticmethod
    async def _hang_up(out: SseOut, stream: iostream.IOStream, *, drain: bool) -> None:
        with contextlib.suppress(OSError):
            out.sock.shutdown(socket.SHUT_WR)
        if drain:
            await _linger(stream)
        stream.close()

    async def _stream(self, params: LiveParams, model: str, stream: iostream.IOStream, out: SseOut) -> bool:
        """Transcribe the body into the response; whether the body was read to its terminating chunk."""
        body = ChunkedBody(stream, self.service.settings.live_limits)
        transcriber = SidecarTranscriber(self, model, {"language": params.language, "prompt": params.prompt})
        listener = _Deltas(out)
        speech = SpeechInput(transcriber, listener, sample_rate=WHISPER_RATE, vad=VadSettings(), busy=transcriber.busy)
        error: LemonkitError | None = None
        try:
            listener.reading = asyncio.ensure_future(self._read(body, speech, params))
            await listener.reading
            await speech.finish()
        except asyncio.CancelledError:
            if listener.failure is None and not out.gone:
                raise  # this handler is being stopped, not the session failing
        except LemonkitError as err:
            error = err
        finally:
            speech.close()
        error = error or listener.failure
        if error is not None:
            log.info("%s %s -> error event: %s", self.request.method, self.request.path, error.message)
            await out.frame(error_event(error))
        else:
            await out.event({"type": "transcript.text.done", "text": listener.text.text})
            await out.frame(sse.DONE)
        await out.end()
        return body.complete

    @staticmethod
    async def _read(body: ChunkedBody, speech: SpeechInput, params: LiveParams) -> None:
        pcm = PcmDecoder(params)
        while (data := await body.next()) is not None:
            await speech.feed(pcm.decode(data))
        await speech.feed(pcm.flush())


class PcmDecoder:
    """The body's interleaved PCM, in pieces cut anywhere, as mono float32 at Whisper's rate (16 kHz): the
    utterances the front holds stay small whatever the capture rate, and the sidecar gets what it works at.
    A stateful resampler, so that piece boundaries leave no seams; microseconds per piece."""

    def __init__(self, params: LiveParams) -> None:
        self.params = params
        self._left = b""
        self._resampler = None
        if params.sample_rate != WHISPER_RATE:
            import soxr  # the audio extra's, like the engines that transcribe

            self._resampler = soxr.ResampleStream(params.sample_rate, WHISPER_RATE, 1, dtype="float32")

    def decode(self, data: bytes) -> np.ndarray:
        data = self._left + data
        usable = len(data) - len(data) % self.params.frame_bytes
        self._left = data[usable:]
        p = self.params
        samples = from_pcm(data[:usable], sample_rate=p.sample_rate, channels=p.channels, sample_format=p.sample_format)
        return self._resampler.resample_chunk(samples) if self._resampler is not None else samples

    def flush(self) -> np.ndarray:
        """What the resampler still holds, at the end of the body."""
        empty = np.zeros(0, dtype=np.float32)
        return self._resampler.resample_chunk(empty, last=True) if self._resampler is not None else empty


async def _linger(stream: iostream.IOStream) -> None:
    """Read (and drop) what the client still sends, briefly, until it closes its side."""
    deadline = time.monotonic() + _LINGER
    with contextlib.suppress(iostream.StreamClosedError, asyncio.TimeoutError):
        while not stream.closed() and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait_for(stream.read_bytes(_PIECE, partial=True), left)
