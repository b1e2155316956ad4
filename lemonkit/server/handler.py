"""The behaviour every lemonkit handler shares, whatever host serves it.

Handlers are written once as subclasses of :class:`LemonkitHandler` (a mixin
with no Tornado base); each host combines them with its own request handler
class (Jupyter's ``APIHandler`` or a plain ``RequestHandler``), which adds
authentication. See :func:`lemonkit.server.routes.build`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any

import httpx
from tornado import web, websocket
from tornado.iostream import IOStream, StreamClosedError

from lemonkit.backends import handoff
from lemonkit.backends.protocol import Upload
from lemonkit.errors import (
    AdminRequired,
    BackendError,
    InvalidJSON,
    InvalidRequest,
    LemonkitError,
    NotFound,
    RetryLater,
    error_from_body,
)
from lemonkit.formats import schemas, sse
from lemonkit.formats.bodies import parse_json
from lemonkit.formats.headers import HANDOFF_HEADER
from lemonkit.server.service import SETTINGS_KEY, Service
from lemonkit.serving import fairness
from lemonkit.serving.caller import OWNER, Caller, current

if TYPE_CHECKING:
    from lemonkit.serving.loaded_model import LoadedModel

    _Base = web.RequestHandler
    _WebSocketBase = websocket.WebSocketHandler
else:
    _Base = _WebSocketBase = object

__all__ = [
    "API_PREFIXES",
    "SSE_HEADERS",
    "LemonkitHandler",
    "LemonkitWebSocket",
    "allow_unauthenticated",
    "as_lemonkit_error",
]

log = logging.getLogger("lemonkit.server")

JSON = "application/json"
#: every versioned route is served under each of these (the route table's, and what a handler finds its root by)
API_PREFIXES = ("api/v1/", "v1/", "api/v0/", "v0/")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_HTTP_CODES = {401: "invalid_api_key", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}


def allow_unauthenticated(method: Any) -> Any:
    """Mark a handler method as open (``/live``); both hosts honour it."""
    method.__allow_unauthenticated = True  # the attribute jupyter_server's own check reads
    return method


def as_lemonkit_error(exc: BaseException | None, status: int) -> LemonkitError:
    """The :class:`LemonkitError` a failed request answers with (an unexpected exception: a 500 that hides it)."""
    if isinstance(exc, LemonkitError):
        return exc
    if isinstance(exc, web.HTTPError):
        message = exc.log_message or exc.reason or f"HTTP {exc.status_code}"
        err = LemonkitError(message % exc.args if exc.args else message, status=exc.status_code)
        err.code = _HTTP_CODES.get(exc.status_code, "http_error")
        err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return err
    return LemonkitError("The request failed unexpectedly; see the server log", status=status, code="internal_error")


class LemonkitHandler(_Base):
    """Shared base of every lemonkit route: JSON in, OpenAI-shaped errors out, SSE helpers."""

    #: the schemas.validate() route name of this handler's JSON body, if it has one
    schema: str | None = None
    #: hosts refuse requests without credentials unless this is False
    auth_required = True
    _sse_open = False
    _client_gone = False
    _waiting: asyncio.Future[Any] | None = None

    @property
    def service(self) -> Service:
        service: Service = self.settings[SETTINGS_KEY]
        return service

    @property
    def caller(self) -> Caller:
        """Who sent this request: a shared host sets it once it authenticated them; else the server's owner."""
        return getattr(self, "_lemonkit_caller", OWNER)

    def set_caller(self, who: Caller) -> None:
        """Record the authenticated caller (hosts call this in ``prepare``), also for log records and jobs."""
        self._lemonkit_caller = who
        current.set(who)

    def require_admin(self, what: str) -> None:
        """Refuse ``what`` (e.g. "pulling a model") unless the caller may change what all users share.

        Raises:
            AdminRequired: A shared server's user who is not one of its admins.
        """
        if not self.caller.admin:
            raise AdminRequired(f"Only an admin of this shared server may do this: {what}")

    # -- errors --------------------------------------------------------------------------------------------------

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        err = as_lemonkit_error(exc, status_code)
        if self._sse_open:
            return  # the stream writer already reported it as an error event
        self.clear()
        self.set_status(err.status)
        if isinstance(err, RetryLater):
            self.set_header("Retry-After", str(max(1, math.ceil(err.retry_after))))
        self.set_header("Content-Type", "application/json")
        if self._body_unread():
            # Tornado closes the connection after answering a streamed body it did not read, without saying so;
            # a client that keeps the connection for its next request would read that close as a broken answer
            self.set_header("Connection", "close")
        self.finish(json.dumps(err.to_dict()))

    def _body_unread(self) -> bool:
        """A streamed body (uploads, live audio) refused in ``prepare``, before Tornado read it."""
        future = getattr(self.request, "_body_future", None)  # Tornado's: done once the whole body was read
        return bool(getattr(self, "_stream_request_body", False)) and future is not None and not future.done()

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, LemonkitError) and value.status < 500:
            log.info("%s %s -> %s %s", self.request.method, self.request.path, value.status, value.message)
        elif isinstance(value, (LemonkitError, web.HTTPError)):
            log.warning("%s %s -> %s", self.request.method, self.request.path, value)
        else:
            super().log_exception(typ, value, tb)

    # -- request and response bodies -----------------------------------------------------------------------------

    def json_body(self, *, optional: bool = False) -> dict[str, Any]:
        """The request body, parsed and (when the handler names a schema) validated.

        Raises:
            InvalidJSON: The body is not a JSON object (or nests too deep).
            MissingArgument, InvalidArgument: The schema refused it.
        """
        raw = self.request.body
        if optional and not raw.strip():
            body: Any = {}
        else:
            body = parse_json(raw)
        if not isinstance(body, dict):
            raise InvalidJSON("The body is not a JSON object")
        return schemas.validate(self.schema, body) if self.schema is not None else body

    def write_json(self, data: Any, status: int = 200) -> None:
        self.write_encoded(json.dumps(data), status)

    def write_encoded(self, payload: str, status: int = 200) -> None:
        """A JSON body encoded already (an answer the answer cache kept in the same bytes)."""
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(payload)

    # -- server-sent events --------------------------------------------------------------------------------------

    async def sse_open(self) -> None:
        """Send the stream's headers now, so the client sees the stream start (and pings) at once."""
        self.set_status(200)
        for name, value in SSE_HEADERS.items():
            self.set_header(name, value)
        self._sse_open = True
        await self.flush()

    def no_delay(self) -> None:
        """Send each write at once: a stream's events are small, and Nagle's algorithm would hold one back until
        the client acknowledged the last (which it may delay by 40 ms or more). Tornado restores the default when
        the response finishes."""
        connection = self.request.connection
        stream = getattr(connection, "stream", None)
        if stream is not None:
            stream.set_nodelay(True)

    async def sse_write(self, data: bytes) -> None:
        """Write and flush one frame.

        Raises:
            StreamClosedError: The client went away.
        """
        self.write(data)
        await self.flush()

    def on_connection_close(self) -> None:
        super().on_connection_close()
        self._client_gone = True
        if self._waiting is not None:
            # ends a stream's upstream read (the sidecar stops generating), a load's wait, a download's wait
            self._waiting.cancel()

    async def unless_gone(self, work: Awaitable[Any]) -> bool:
        """Await ``work``, cancelling it if the client hangs up meanwhile.

        Returns:
            ``False`` when the client left (``work`` was cancelled), ``True`` when ``work`` finished.
        """
        outer, self._waiting = self._waiting, asyncio.ensure_future(work)
        try:
            await self._waiting
        except asyncio.CancelledError:
            if self._client_gone:
                return False
            raise
        finally:
            self._waiting = outer
        return True

    async def pump(self, frames: AsyncIterator[bytes]) -> None:
        """Stream ``frames`` to the client until they end or the client leaves."""

        async def run() -> None:
            async for frame in frames:
                await self.sse_write(frame)

        self.no_delay()
        try:
            if not await self.unless_gone(run()):
                return
        except StreamClosedError:
            return
        self.finish()

    # -- talking to a model's sidecar ----------------------------------------------------------------------------

    async def sidecar_request(
        self,
        model: LoadedModel,
        path: str,
        body: dict[str, Any],
        *,
        files: list[Upload] | None = None,
        hand_off: bool = False,
    ) -> httpx.Response:
        """POST ``body`` to the sidecar; the response is open for streaming.

        Args:
            files: Audio for a ``files`` route of :data:`lemonkit.backends.protocol.ROUTES`: sent base64 in
                ``body["files"]``, encoded off the event loop.
            hand_off: Offer the sidecar the client's connection for an SSE answer (see :meth:`sidecar_stream`).

        Raises:
            BackendError: The sidecar is unreachable (it is discarded) or answered with an error.
        """
        client = model.client
        headers = {HANDOFF_HEADER: "1"} if hand_off else {}
        if fairness.background.get() and model.info.recipe == "llamacpp" and "priority" not in body:
            body = {**body, "priority": 1}  # a batch's row: behind interactive requests in llama.cpp's steps too
        if files is None:
            request = client.build_request("POST", path, json=body, headers=headers)
        else:
            content = await asyncio.to_thread(_with_files, body, files)
            request = client.build_request("POST", path, content=content, headers={"Content-Type": JSON, **headers})
        try:
            response = await client.send(request, stream=True)
        except httpx.TransportError as exc:
            self.service.manager.discard(model)
            raise BackendError(
                f"The engine of {model.name} is not responding ({exc}); retry to reload it", status=502
            ) from None
        if response.status_code != 200:
            raw = await response.aread()
            await response.aclose()
            raise _sidecar_error(raw, response.status_code)
        return response

    async def sidecar_stream(
        self, model: LoadedModel, path: str, body: dict[str, Any], *, files: list[Upload] | None = None
    ) -> None:
        """Answer with the SSE stream of the sidecar's ``path``.

        The sidecar writes it to the client itself when this connection can be handed over (see
        :mod:`lemonkit.backends.handoff`); otherwise the events pass through here.

        Raises:
            BackendError: The sidecar is unreachable (it is discarded) or refused the request up front.
        """
        response = await self.sidecar_request(model, path, body, files=files, hand_off=self._can_hand_off(model))
        token = response.headers.get(HANDOFF_HEADER)
        if token is None:
            await self.sse_open()
            await self.pump(self.sidecar_frames(model, response))
            return
        assert model.socket_path is not None
        self.set_header("Connection", "close")  # the sidecar ends the stream; the connection ends with it
        await self.sse_open()
        self.no_delay()
        stream = self.detach()
        try:
            async with self._reading(model, response, "stopped mid-stream"):
                try:
                    await handoff.hand_over(handoff.path_for(model.socket_path), token, stream.socket)
                except OSError as exc:
                    self.service.manager.discard(model)
                    message = f"The engine of {model.name} did not take the stream ({exc})"
                    raise BackendError(message, status=502) from None
                await response.aread()  # the sidecar's account of how it ended, once it has
        except BackendError as exc:
            with contextlib.suppress(StreamClosedError):
                await stream.write(handoff.chunk(error_event(exc)) + handoff.LAST_CHUNK)
        finally:
            self._finished_elsewhere()
            stream.close()

    def _finished_elsewhere(self) -> None:
        """What ``finish()`` would have done for a response the sidecar wrote: log it, and on Jupyter record the
        API activity (idle culling reads it) as ``APIHandler.finish`` does."""
        update_activity = getattr(self, "update_api_activity", None)
        if update_activity is not None:
            update_activity()
        self.application.log_request(self)

    def _can_hand_off(self, model: LoadedModel) -> bool:
        """Whether the sidecar could write this response to the client itself: plain HTTP/1.1 (which tornado
        sends chunked) on a socket it can receive, with no transform of the body on the way."""
        return (
            model.socket_path is not None
            and self.request.version == "HTTP/1.1"
            and type(getattr(self.request.connection, "stream", None)) is IOStream  # not TLS
            and not (self.settings.get("compress_response") or self.settings.get("gzip"))
        )

    async def sidecar_json(
        self, model: LoadedModel, path: str, body: dict[str, Any], *, files: list[Upload] | None = None
    ) -> dict[str, Any]:
        """POST ``body`` (and ``files``) to the sidecar and return its JSON answer (see :meth:`sidecar_request`)."""
        response = await self.sidecar_request(model, path, body, files=files)
        result: dict[str, Any] = json.loads(await self.sidecar_body(model, response))
        return result

    async def sidecar_body(self, model: LoadedModel, response: httpx.Response) -> bytes:
        """The whole body of an answer :meth:`sidecar_request` opened.

        Raises:
            BackendError: The sidecar died before the body ended (it is discarded).
        """
        async with self._reading(model, response, "died during the request"):
            body = await response.aread()
        return body

    @contextlib.asynccontextmanager
    async def _reading(self, model: LoadedModel, response: httpx.Response, failure: str) -> AsyncIterator[None]:
        """Read ``response`` within: a sidecar that dies meanwhile is discarded and becomes a 502; the response
        is closed after."""
        try:
            yield
        except httpx.TransportError:
            self.service.manager.discard(model)
            raise BackendError(f"The engine of {model.name} {failure}; retry to reload it", status=502) from None
        finally:
            await response.aclose()

    async def sidecar_feed(
        self, model: LoadedModel, response: httpx.Response
    ) -> AsyncGenerator[dict[str, Any] | None, None]:
        """The JSON events of an SSE answer :meth:`sidecar_request` opened, as they arrive, and None for each
        keep-alive comment (a relay passes it on as :data:`lemonkit.formats.sse.PING`). The one reader of sidecar
        streams, so every route has the same error policy. Close it (``contextlib.aclosing``) to end the sidecar's work
        early.

        Raises:
            LemonkitError: The error event the sidecar sent, as the error it stands for (:func:`stream_error`):
                each route writes it in its own API's error shape.
            BackendError: The sidecar died, or its stream ended without ``[DONE]``, before the answer ended (a
                502 naming the model; a dead sidecar is discarded, so the next request reloads it).
        """
        done = False
        async with self._reading(model, response, "stopped mid-answer"):
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise stream_error(event)
                    yield event
                elif line == "data: [DONE]":
                    done = True
                elif line.startswith(":"):
                    yield None
        if not done:
            raise BackendError(f"The engine of {model.name} stopped mid-answer; retry to reload it", status=502)

    async def sidecar_events(
        self, model: LoadedModel, response: httpx.Response
    ) -> AsyncGenerator[dict[str, Any], None]:
        """:meth:`sidecar_feed` without the keep-alives, for a caller that reads the events rather than passing
        them on."""
        async with contextlib.aclosing(self.sidecar_feed(model, response)) as events:
            async for event in events:
                if event is not None:
                    yield event

    async def sidecar_frames(self, model: LoadedModel, response: httpx.Response) -> AsyncIterator[bytes]:
        """The sidecar's SSE bytes as they arrive; a failure becomes one error event and the stream ends."""
        tail = b"\n\n"
        try:
            async for chunk in response.aiter_raw():
                tail = chunk[-2:]
                yield chunk
        except httpx.TransportError:
            self.service.manager.discard(model)
            prefix = b"" if tail == b"\n\n" else b"\n\n"  # never glue the error onto a half-sent event
            yield prefix + error_event(
                BackendError(f"The engine of {model.name} stopped mid-stream; retry to reload it", status=502)
            )
        finally:
            await response.aclose()


def _with_files(body: dict[str, Any], files: list[Upload]) -> bytes:
    encoded = [
        {"filename": f.filename, "content_type": f.content_type, "data": base64.b64encode(f.content).decode()}
        for f in files
    ]
    return json.dumps({**body, "files": encoded}).encode()


def stream_error(event: dict[str, Any]) -> LemonkitError:
    """The exception an error event of a sidecar's stream (``{"error": {..., "status_code"}}``) stands for."""
    error = event.get("error")
    status = error.get("status_code") if isinstance(error, dict) else None
    return error_from_body(status if isinstance(status, int) else None, event)


def error_event(err: LemonkitError) -> bytes:
    """The SSE frame that replaces the rest of a stream that failed after it started."""
    body = {"error": {"message": err.message, "type": err.type, "code": err.code, "status_code": err.status}}
    return sse.frame(body)


def _sidecar_error(raw: bytes, status: int) -> LemonkitError:
    try:
        detail = json.loads(raw)["error"]
        err = LemonkitError(str(detail.get("message")), status=status, code=detail.get("code"))
        err.type = detail.get("type") or err.type
        return err
    except (ValueError, KeyError, TypeError, AttributeError):
        return BackendError(f"The engine answered {status}: {raw[:200]!r}", status=status)


class LemonkitWebSocket(LemonkitHandler, _WebSocketBase):
    """Shared base of the WebSocket routes; each host joins it to a WebSocket host base (auth before the upgrade).

    Everything refused before the upgrade (credentials, a request that is not an upgrade) is a JSON error
    like any route's; after it, errors are ``{"type": "error", "error": {...}}`` messages.
    """

    async def get(self, *args: Any, **kwargs: Any) -> None:
        # Tornado's own answer is plain text: check first, so that it is a JSON error like any other
        if self.request.headers.get("Upgrade", "").lower() != "websocket":
            raise InvalidRequest(
                "This route is a WebSocket: send an 'Upgrade: websocket' request", code="not_websocket"
            )
        await super().get(*args, **kwargs)

    def send_error_message(self, err: LemonkitError) -> None:
        with contextlib.suppress(websocket.WebSocketClosedError):
            self.write_message(json.dumps({"type": "error", **err.to_dict()}))


class NotFoundHandler(LemonkitHandler):
    """Any path under the API that no route serves: a 404 once the host's checks (credentials first) passed."""

    def _not_found(self, *args: Any, **kwargs: Any) -> None:
        raise NotFound(f"No route for {self.request.method} {self.request.path}")

    get = head = post = put = patch = delete = options = _not_found
