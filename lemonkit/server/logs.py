"""``WS /logs/stream``: the server's log history, then its live entries (spec: "Log Streaming API").

After ``logs.subscribe`` (optionally with ``after_seq``), one task per connection sends the
``logs.snapshot`` and then, each time the store wakes it, ``logs.entry`` messages for what
it has not sent yet, awaiting each write: a slow client holds back only its own reads from
the store, never the loop or the other subscribers, and no queue grows for it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tornado.websocket import WebSocketClosedError

from lemonkit.errors import InvalidArgument, InvalidJSON, LemonkitError
from lemonkit.formats.bodies import parse_json
from lemonkit.server.handler import LemonkitWebSocket
from lemonkit.serving.log_store import STORE

#: where the handler is served, off a host's root (the route table's entry, and what ``/v1/health`` reports)
LOG_STREAM_PATH = "logs/stream"

__all__ = ["LOG_STREAM_PATH", "SNAPSHOT_BYTES", "LogStreamHandler"]

#: the most a ``logs.snapshot`` message carries: the newest entries that fit (the spec's "up to 5000"), within
#: what WebSocket clients accept by default (Python's websockets: 1 MiB; Tornado's: 10 MiB)
SNAPSHOT_BYTES = 1_000_000


def _newest_within(entries: list[str], budget: int) -> list[str]:
    kept, size = [], 0
    for entry in reversed(entries):
        size += len(entry.encode()) + 2
        if size > budget:
            break
        kept.append(entry)
    kept.reverse()
    return kept


def _parse(message: str | bytes) -> int | None:
    """``after_seq`` of a valid subscribe message.

    Raises:
        InvalidJSON, InvalidArgument: Any other message.
    """
    msg = parse_json(message, "message")
    if not isinstance(msg, dict):
        raise InvalidJSON("The message is not a JSON object")
    if msg.get("type") != "logs.subscribe":
        raise InvalidArgument(f"type: unknown message type {msg.get('type')!r}; expected 'logs.subscribe'")
    after: Any = msg.get("after_seq")
    if after is not None and (isinstance(after, bool) or not isinstance(after, int)):
        raise InvalidArgument(f"after_seq: expected an integer or null, got {type(after).__name__}")
    return after


class LogStreamHandler(LemonkitWebSocket):
    """A shared server's user who is not an admin sees only the records logged for their own requests."""

    _sender: asyncio.Task[None] | None = None

    def on_message(self, message: str | bytes) -> None:
        try:
            after_seq = _parse(message)
        except LemonkitError as err:
            self.send_error_message(err)
            return
        if self._sender is not None:
            self._sender.cancel()  # subscribing again starts over from the new after_seq
        self._sender = asyncio.ensure_future(self._send(after_seq))

    def on_close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()

    async def _send(self, after_seq: int | None) -> None:
        wake = STORE.watch()  # before reading the store: an entry added in between still wakes us
        only_of = self.caller.own_only
        try:
            entries, last = STORE.since(after_seq, only_of=only_of)
            entries = _newest_within(entries, SNAPSHOT_BYTES - 64)
            await self.write_message('{"type": "logs.snapshot", "entries": [' + ", ".join(entries) + "]}")
            while True:
                await wake.wait()
                wake.clear()
                entries, last = STORE.since(last, only_of=only_of)
                for entry in entries:
                    await self.write_message('{"type": "logs.entry", "entry": ' + entry + "}")
        except WebSocketClosedError:
            pass
        finally:
            STORE.unwatch(wake)
