"""Parsing what a client sends (request bodies, WebSocket messages) as strict, bounded JSON.

Every later step (validation, the sidecar's own ``json.dumps``, grammar building, tokenizing)
walks the parsed value recursively or encodes its strings as UTF-8, so both are settled here,
once, before any of them runs: a body of a few thousand ``[`` answers 400 ``invalid_json``
rather than a ``RecursionError`` somewhere deep, and so does a lone surrogate (``"\\ud800"``),
which no UTF-8 encoder takes. Bytes must be UTF-8 (RFC 8259); ``NaN`` and ``Infinity`` are not JSON
and are refused too, and numbers that overflow to them are refused as ``invalid_argument``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from typing import Any

from lemonkit.errors import InvalidArgument, InvalidJSON

__all__ = ["MAX_DEPTH", "decode_base64", "parse_json"]

#: deepest nesting of arrays and objects accepted (JSON schemas and tool parameters stay far below it)
MAX_DEPTH = 128


def _constant(name: str) -> Any:
    raise InvalidJSON(f"{name} is not a JSON value")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        # JSON, but no field takes it: the same answer as a schema's range check
        raise InvalidArgument(f"the number {text[:40]} is out of range")
    return value


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_tree(value: Any, what: str) -> None:
    """Walk ``value`` without recursion: refuse nesting beyond :data:`MAX_DEPTH` and unpaired surrogates."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not _encodable(node):
                raise InvalidJSON(f"The {what} is not valid JSON: a string holds an unpaired surrogate")
            continue
        if isinstance(node, dict):
            children = [*node, *node.values()]
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth >= MAX_DEPTH:
            raise _too_deep(what)
        stack.extend((child, depth + 1) for child in children)


def _too_deep(what: str) -> InvalidJSON:
    return InvalidJSON(f"The {what} nests arrays and objects deeper than {MAX_DEPTH} levels")


def parse_json(raw: bytes | str, what: str = "body") -> Any:
    """``raw`` as strict JSON, nested at most :data:`MAX_DEPTH` deep.

    Args:
        raw: The bytes (UTF-8) or text received.
        what: How an error message names it ("body", "message").

    Raises:
        InvalidJSON: It is not strict UTF-8 JSON, or nests too deep.
        InvalidArgument: A number overflows a float.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        value = json.loads(text, parse_constant=_constant, parse_float=_float)
    except InvalidJSON as exc:
        raise InvalidJSON(f"The {what} is not valid JSON: {exc.message}") from None
    except InvalidArgument:
        raise
    except RecursionError:
        raise _too_deep(what) from None
    except UnicodeDecodeError:
        raise InvalidJSON(f"The {what} is not UTF-8") from None
    except ValueError:
        raise InvalidJSON(f"The {what} is not valid JSON") from None
    _check_tree(value, what)
    return value


#: a data URL's head (``data:image/png;base64,``), which clients that read a file in a browser leave on
_DATA_URL = re.compile(r"^data:[\w.+-]+/[\w.+-]+(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.IGNORECASE)


def decode_base64(text: str, *, what: str = "image", noun: str = "image", allow_empty: bool = False) -> bytes:
    """The bytes of a base64 field (a ``data:...;base64,`` head is allowed; whitespace is ignored).

    Args:
        text: The field's value.
        what: The field, for messages.
        noun: What the bytes are (``image``, ``WAV file``...), for messages.
        allow_empty: Zero bytes are a value (an artifact's payload may be empty).

    Raises:
        InvalidArgument: Not base64, or empty unless ``allow_empty``.
    """
    text = _DATA_URL.sub("", text.strip(), count=1)
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"{what}: expected a base64-encoded {noun} ({exc})") from None
    if not data and not allow_empty:
        raise InvalidArgument(f"{what}: the {noun} is empty")
    return data
