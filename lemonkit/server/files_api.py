"""The OpenAI Files API (spec: ``openai-api.md``, Files): ``POST /v1/files`` (a streamed multipart upload),
``GET /v1/files``, ``GET`` and ``DELETE /v1/files/{id}``, ``GET /v1/files/{id}/content``.

An upload goes straight to disk as it arrives (:class:`~lemonkit.serving.file_store.NewFile`): a 200 MB batch
file never sits in memory, and one over ``files_max_bytes`` is answered 413 with nothing of it kept. Files are the
caller's own: on a shared server another user's id is a 404, as an unknown one.
"""

from __future__ import annotations

import asyncio
from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from tornado import web
from tornado.iostream import StreamClosedError

from lemonkit.errors import InvalidArgument, InvalidRequest, LemonkitError, MissingArgument, NotFound, TooLarge
from lemonkit.server.handler import LemonkitHandler
from lemonkit.serving.file_store import PURPOSES, NewFile

__all__ = ["FileContentHandler", "FileHandler", "FilesHandler", "list_page"]

#: bytes of multipart framing and text fields an upload may carry besides its file
_FRAMING = 64 * 1024
#: the most of a refused upload's body read and dropped before answering: a server that answers and closes while
#: the client still sends makes the client's kernel reset the connection, and the answer is lost with it
_LINGER = 1024 * 1024
#: bytes read from disk at a time when a file's content is sent
_READ = 256 * 1024


def list_page(objects: list[dict[str, Any]], *, after: str | None, limit: int) -> dict[str, Any]:
    """A page of OpenAI's cursor lists: the objects after the one whose id is ``after`` (all when it is
    ``None``), at most ``limit``, with ``first_id``, ``last_id`` and ``has_more``.

    Raises:
        InvalidArgument: ``after`` names no object of the list.
    """
    start = 0
    if after is not None:
        ids = [o["id"] for o in objects]
        if after not in ids:
            raise InvalidArgument(f"after: no object with id {after!r} in this list")
        start = ids.index(after) + 1
    page = objects[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(objects),
    }


def query_limit(handler: LemonkitHandler, default: int, most: int) -> int:
    """The ``limit`` query argument of a list route, checked."""
    raw = handler.get_query_argument("limit", None)
    if raw is None:
        return default
    try:
        limit = int(raw)
    except ValueError:
        raise InvalidArgument(f"limit: expected an integer, got {raw!r}") from None
    if not 1 <= limit <= most:
        raise InvalidArgument(f"limit: must be between 1 and {most}, got {limit}")
    return limit


class _Upload:
    """Reads one multipart body as it arrives: text fields kept, the ``file`` part written to a new file."""

    def __init__(self, handler: FilesHandler, boundary: bytes, limit: int) -> None:
        self.handler, self.limit = handler, limit
        self.fields: dict[str, str] = {}
        self.file: NewFile | None = None
        self.filename = ""
        self.too_large = False
        self._headers: dict[bytes, bytes] = {}
        self._field, self._value = b"", b""
        self._part: str | None = None
        self._text = bytearray()
        self._in_file = False
        callbacks: Any = {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: self._add("_field", d[s:e]),
            "on_header_value": lambda d, s, e: self._add("_value", d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_done,
            "on_part_data": self._data,
            "on_part_end": self._end,
        }
        self.parser = MultipartParser(boundary, callbacks)

    def _add(self, name: str, data: bytes) -> None:
        setattr(self, name, getattr(self, name) + data)

    def _begin(self) -> None:
        self._headers, self._part, self._in_file = {}, None, False
        self._text.clear()

    def _header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _headers_done(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        self._part = name
        if name == "file" and self.file is None:
            self.filename = options.get(b"filename", b"upload").decode("utf-8", "replace") or "upload"
            self._in_file = True
            self.file = self.handler.service.files.create(self.handler.caller.name, self.filename, "pending")

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            assert self.file is not None
            if self.file.bytes + (end - start) > self.limit:
                self.too_large = True
                self._in_file = False  # the rest of the body is read and dropped
                return
            self.file.write(memoryview(data)[start:end])
        elif self._part is not None and len(self._text) + (end - start) <= 4096:
            self._text += data[start:end]

    def _end(self) -> None:
        if self._part is not None and self._part != "file":
            self.fields[self._part] = self._text.decode("utf-8", "replace")
        self._in_file = False

    def feed(self, chunk: bytes) -> None:
        if not self.too_large:
            self.parser.write(chunk)

    def close(self) -> None:
        if self.file is not None:
            self.file.discard()


class FilesHandler(LemonkitHandler):
    """``POST /v1/files`` (multipart ``file`` and ``purpose``) and ``GET /v1/files``."""

    _stream_request_body = True  # what @tornado.web.stream_request_body sets (see LiveTranscriptionHandler)
    raw_body = True
    _upload: _Upload | None = None
    _refusal: LemonkitError | web.HTTPError | None = None

    async def prepare(self) -> None:
        declared = self.request.headers.get("Content-Length")
        size = int(declared) if declared is not None and declared.isdigit() else 0
        connection: Any = self.request.connection
        try:
            checked = super().prepare()  # the host's: credentials, Host and Origin
            if checked is not None:
                await checked
        except (LemonkitError, web.HTTPError) as exc:
            if self.request.method != "POST" or size > _LINGER or not hasattr(connection, "set_max_body_size"):
                raise
            connection.set_max_body_size(_LINGER)  # a longer body from a stranger ends the connection
            self._refusal = exc  # answered once the (short) body is read
            return
        if self._finished or self.request.method != "POST":
            return
        limit = self.service.settings.files_max_bytes
        # a body somewhat over the limit is read and dropped, so that the client (still sending) reads the 413;
        # one far over it is refused at once, the connection closed
        drain = 4 * limit + 64 * 1024 * 1024
        if size > drain:
            raise TooLarge(self._too_large_message(limit))
        if connection is not None and hasattr(connection, "set_max_body_size"):
            connection.set_max_body_size(max(size, limit + _FRAMING))
        if size > limit + _FRAMING:
            self._refusal = TooLarge(self._too_large_message(limit))
            return
        content_type, options = parse_options_header(self.request.headers.get("Content-Type", ""))
        boundary = options.get(b"boundary")
        if content_type != b"multipart/form-data" or not boundary:
            # refused once the body is read: answering before it leaves the client writing into a closed socket
            self._refusal = InvalidRequest(
                "POST /v1/files takes multipart/form-data with a 'file' part and a 'purpose' field",
                code="invalid_content_type",
            )
            return
        self._upload = _Upload(self, boundary, limit)

    def _too_large_message(self, limit: int) -> str:
        return (
            f"The file is larger than this server takes ({limit} bytes; the operator sets it with "
            "LEMONKIT_FILES_MAX_BYTES)"
        )

    async def data_received(self, chunk: bytes) -> None:
        upload = self._upload
        if upload is None:
            return
        try:
            await asyncio.to_thread(upload.feed, chunk)
        except MultipartParseError as exc:
            upload.close()
            self._upload = None
            self._refusal = InvalidRequest(f"The multipart body is malformed: {exc}", code="invalid_multipart")

    def on_finish(self) -> None:
        if self._upload is not None:
            self._upload.close()  # a file not committed (a refusal, a client that left) leaves nothing behind

    def on_connection_close(self) -> None:
        super().on_connection_close()
        if self._upload is not None:
            self._upload.close()

    async def post(self) -> None:
        if self._refusal is not None:
            raise self._refusal
        upload = self._upload
        assert upload is not None
        if upload.too_large:
            raise TooLarge(self._too_large_message(self.service.settings.files_max_bytes))
        purpose = upload.fields.get("purpose")
        if upload.file is None:
            raise MissingArgument("file: required argument is missing (a multipart part with the file)")
        if not purpose:
            raise MissingArgument("purpose: required argument is missing (batch or user_data)")
        if purpose not in PURPOSES:
            raise InvalidArgument(f"purpose: {purpose!r} is not one of {', '.join(PURPOSES)}")
        upload.file.purpose = purpose
        obj = await asyncio.to_thread(upload.file.commit)
        self.write_json(obj)

    async def get(self) -> None:
        purpose = self.get_query_argument("purpose", None)
        order = self.get_query_argument("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidArgument(f"order: must be asc or desc, got {order!r}")
        limit = query_limit(self, 10_000, 10_000)
        objects = await asyncio.to_thread(self.service.files.list, self.caller.name, purpose)
        if order == "asc":
            objects.reverse()
        self.write_json(list_page(objects, after=self.get_query_argument("after", None), limit=limit))


def _not_found(file_id: str) -> NotFound:
    return NotFound(f"No file with id {file_id!r}", code="file_not_found")


class FileHandler(LemonkitHandler):
    """``GET`` and ``DELETE /v1/files/{id}``."""

    async def get(self, file_id: str) -> None:
        obj = await asyncio.to_thread(self.service.files.get, self.caller.name, file_id)
        if obj is None:
            raise _not_found(file_id)
        self.write_json(obj)

    async def delete(self, file_id: str) -> None:
        if not await asyncio.to_thread(self.service.files.delete, self.caller.name, file_id):
            raise _not_found(file_id)
        self.write_json({"id": file_id, "object": "file", "deleted": True})


class FileContentHandler(LemonkitHandler):
    """``GET /v1/files/{id}/content``: the file's bytes, read from disk a piece at a time."""

    async def get(self, file_id: str) -> None:
        path = await asyncio.to_thread(self.service.files.content, self.caller.name, file_id)
        if path is None:
            raise _not_found(file_id)
        try:
            source = await asyncio.to_thread(open, path, "rb")
        except FileNotFoundError:
            raise _not_found(file_id) from None  # deleted meanwhile
        with source:
            self.set_header("Content-Type", "application/octet-stream")
            self.set_header("Content-Length", str(await asyncio.to_thread(lambda: path.stat().st_size)))
            try:
                while chunk := await asyncio.to_thread(source.read, _READ):
                    self.write(chunk)
                    await self.flush()
            except StreamClosedError:
                return
        self.finish()
