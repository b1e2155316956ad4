"""Server-sent events, framed in one place: every SSE frame lemonkit writes, the sidecars' and the server's.

A frame is ``event: <name>`` (when named) and one ``data:`` line of compact-enough JSON, then a blank line; the
OpenAI-style streams end with :data:`DONE`, and ``: ping`` comments keep idle connections open.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DONE", "PING", "comment", "frame"]

#: the frame that ends an OpenAI-style stream
DONE = b"data: [DONE]\n\n"
#: a comment frame: keeps a quiet stream's connection open
PING = b": ping\n\n"


def frame(data: Any, event: str | None = None) -> bytes:
    """One SSE frame: ``data`` as JSON on one line, under ``event`` when given."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def comment(text: str) -> bytes:
    """A comment frame (a line starting with ``:``), passed on as it came."""
    line = text if text.startswith(":") else ": " + text
    return (line + "\n\n").encode()


def frame_data(raw: bytes) -> Any:
    """The JSON of one frame's ``data`` (``None``: a comment, ``[DONE]``, or not JSON)."""
    lines = [line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:")]
    if not lines or lines == [b"[DONE]"]:
        return None
    try:
        return json.loads(b"\n".join(lines))
    except ValueError:
        return None
