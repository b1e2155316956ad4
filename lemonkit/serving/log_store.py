"""The server's log history, for ``WS /logs/stream``: the "lemonkit" loggers and every sidecar's output.

One :class:`LogStore` per process (:data:`STORE`) keeps the last 5000 entries, each
with a monotonic ``seq``. Records arrive from any thread (handlers log from
``asyncio.to_thread`` workers too); subscribers live on an event loop and are woken
with ``call_soon_threadsafe``, then read what they have not sent yet from the store
itself. The store is therefore the only buffer: a slow subscriber costs no memory,
it just skips entries that scrolled out of the window (the ``seq`` gap shows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CAPACITY",
    "STORE",
    "LogStore",
    "RedactSecrets",
    "StoreHandler",
    "capture",
    "install",
    "read_lines",
    "redact",
    "redact_logs",
]

#: entries kept (the spec's backlog size)
CAPACITY = 5000
#: one subprocess line longer than this is cut (a runaway line must not hold the whole window)
MAX_LINE = 8192

_SEVERITIES = [(logging.CRITICAL, "Fatal"), (logging.ERROR, "Error"), (logging.WARNING, "Warning")]
_SEVERITIES += [(logging.INFO, "Info"), (logging.DEBUG, "Debug")]
_LEVEL_WORD = re.compile(r"^\W{0,2}(trace|debug|info|warn(?:ing)?|error|critical|fatal)(?=[\s:\]]|$)", re.I)
_WORD_SEVERITY = {"trace": "Trace", "debug": "Debug", "info": "Info", "warn": "Warning", "warning": "Warning"}
_WORD_SEVERITY |= {"error": "Error", "critical": "Fatal", "fatal": "Fatal"}
_NEWLINES = re.compile(rb"\r\n|\r|\n")
#: query parameters that carry a credential (``?api_key=`` of the standalone WebSocket, Jupyter's ``?token=``)
_SECRET_PARAM = re.compile(r"([?&;](?:api_key|token)=)[^&;#\s\"'<>]*", re.I)


def redact(text: str) -> str:
    """``text`` with the value of every credential query parameter replaced by ``[redacted]``."""
    return _SECRET_PARAM.sub(r"\1[redacted]", text)


class RedactSecrets(logging.Filter):
    """A handler filter that redacts credentials from each record's message (the access log's URIs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


#: the loggers that write request URIs (Tornado's access and error logs)
_URI_LOGGERS = ("tornado.access", "tornado.application", "tornado.general")


def redact_logs() -> None:
    """Put :class:`RedactSecrets` (once) on the loggers that write request URIs, so every handler gets their
    records redacted, and on the root's handlers for whatever else reaches them."""
    for filterer in [*(logging.getLogger(name) for name in _URI_LOGGERS), *logging.getLogger().handlers]:
        if not any(isinstance(f, RedactSecrets) for f in filterer.filters):
            filterer.addFilter(RedactSecrets())


def severity_of(levelno: int) -> str:
    """The spec's severity name for a :mod:`logging` level."""
    for level, name in _SEVERITIES:
        if levelno >= level:
            return name
    return "Trace"


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) + f".{int(created % 1 * 1000):03d}"


@dataclass(frozen=True)
class _Entry:
    seq: int
    encoded: str  # the entry's JSON, serialised once for every subscriber
    user: str | None = None  # whose request it was logged for, on a shared server


class LogStore:
    """A bounded, thread-safe log history that wakes subscribers on its event loops.

    Args:
        capacity: Entries kept; older ones are dropped.
    """

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._entries: deque[_Entry] = deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()
        self._watchers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def last_seq(self) -> int:
        return self._seq

    def add(
        self, severity: str, tag: str, message: str, created: float | None = None, *, user: str | None = None
    ) -> dict[str, Any]:
        """Append one entry (from any thread), credentials redacted, and wake every subscriber; returns the entry.

        Args:
            user: The shared server's user whose request it was logged for (see :meth:`since`).
        """
        message = redact(message)
        if len(message) > MAX_LINE:  # one entry never outweighs a snapshot (a request can echo a huge name)
            message = message[:MAX_LINE] + f"... ({len(message) - MAX_LINE} more characters)"
        timestamp = _timestamp(time.time() if created is None else created)
        with self._lock:
            self._seq += 1
            entry = {
                "seq": self._seq,
                "timestamp": timestamp,
                "severity": severity,
                "tag": tag,
                "line": f"{timestamp} [{severity}] ({tag}) {message}",
            }
            self._entries.append(_Entry(self._seq, json.dumps(entry), user))
            watchers = list(self._watchers)
        current = _running_loop()
        for loop, event in watchers:
            if loop is current:
                event.set()
                continue
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed: its subscriber is gone
                self.unwatch(event)
        return entry

    def since(self, after_seq: int | None, *, only_of: str | None = None) -> tuple[list[str], int]:
        """JSON of the retained entries after ``after_seq`` (all of them for None), and the last seq; with
        ``only_of``, only the entries logged for that user's requests.

        An ``after_seq`` beyond the last seq comes from a client of an earlier server process (seqs restart
        with the process), so it gets everything retained rather than nothing until the counter catches up.
        """
        with self._lock:
            if after_seq is None or after_seq > self._seq or not self._entries:
                start = 0
            else:
                start = max(0, after_seq - self._entries[0].seq + 1)  # seqs are contiguous in the window
            entries = itertools.islice(self._entries, start, None)
            return [e.encoded for e in entries if only_of is None or e.user == only_of], self._seq

    def watch(self) -> asyncio.Event:
        """An event, set on the running loop whenever an entry is added, until :meth:`unwatch`."""
        event = asyncio.Event()
        with self._lock:
            self._watchers.add((asyncio.get_running_loop(), event))
        return event

    def unwatch(self, event: asyncio.Event) -> None:
        with self._lock:
            self._watchers = {w for w in self._watchers if w[1] is not event}


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


#: the process's log history
STORE = LogStore()


class StoreHandler(logging.Handler):
    """Copies records into a :class:`LogStore`, tagged with the logger's name below ``lemonkit.`` and with the
    record's ``lemonkit_user`` (a filter of the server sets it: whose request it was logged for)."""

    def __init__(self, store: LogStore = STORE) -> None:
        super().__init__()
        self.store = store

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            tag = record.name.removeprefix("lemonkit.") if record.name != "lemonkit" else "lemonkit"
            user = getattr(record, "lemonkit_user", None)
            self.store.add(severity_of(record.levelno), tag, message, record.created, user=user)
        except Exception:
            self.handleError(record)


def install(logger_name: str = "lemonkit") -> None:
    """Capture the ``logger_name`` hierarchy into :data:`STORE` (idempotent).

    A hierarchy nobody configured inherits the root's WARNING, which would keep Info out of the stream; it is
    set to INFO then. An explicit level (``lemonkit serve --log-level``) is left alone.
    """
    logger = logging.getLogger(logger_name)
    if not any(isinstance(h, StoreHandler) for h in logger.handlers):
        logger.addHandler(StoreHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


async def read_lines(stream: asyncio.StreamReader) -> AsyncIterator[str]:
    """A subprocess pipe's lines as they arrive (``\\r`` ends a line too: progress bars redraw with it).

    Reads in chunks rather than with ``readline``, so a huge line comes in :data:`MAX_LINE` pieces instead of
    raising (or holding the whole window as one entry); blank lines are skipped.
    """
    pending = b""
    while chunk := await stream.read(65536):
        *lines, pending = _NEWLINES.split(pending + chunk)
        while len(pending) > MAX_LINE:
            lines.append(pending[:MAX_LINE])
            pending = pending[MAX_LINE:]
        for raw in lines:
            for start in range(0, len(raw), MAX_LINE):
                piece = raw[start : start + MAX_LINE].decode("utf-8", "replace").rstrip()
                if piece.strip():
                    yield piece
    if pending.strip():
        yield pending.decode("utf-8", "replace").rstrip()


def line_severity(line: str, default: str = "Info") -> str:
    """Severity of a subprocess line that starts with a level word (``ERROR: ...``, ``[warning] ...``)."""
    m = _LEVEL_WORD.match(line)
    return _WORD_SEVERITY[m.group(1).lower()] if m else default


async def capture(
    stream: asyncio.StreamReader, tag: str, *, tail: deque[str] | None = None, store: LogStore = STORE
) -> None:
    """Copy a subprocess pipe into ``store`` under ``tag`` until EOF, keeping the last lines in ``tail``.

    Runs as its own task for the life of the process: the pipe must always be drained, or the child
    blocks once the pipe buffer is full.
    """
    with contextlib.suppress(ConnectionError):
        async for line in read_lines(stream):
            if tail is not None:
                tail.append(line)
            store.add(line_severity(line), tag, line)
