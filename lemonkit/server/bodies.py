"""Parsing what a client sends (request bodies, WebSocket messages) as strict, bounded JSON.

Every later step (validation, the sidecar's own ``json.dumps``, grammar building) walks the
parsed value recursively, so depth is bounded here, once, before any of them runs: a body of a
few thousand ``[`` answers 400 ``invalid_json`` rather than a ``RecursionError`` somewhere deep.
``NaN``, ``Infinity`` and numbers that overflow to them are not JSON and are refused too.
"""

from __future__ import annotations

import json
import math
from typing import Any

from lemonkit.errors import InvalidJSON

__all__ = ["MAX_DEPTH", "parse_json"]

#: deepest nesting of arrays and objects accepted (JSON schemas and tool parameters stay far below it)
MAX_DEPTH = 128


def _constant(name: str) -> Any:
    raise InvalidJSON(f"{name} is not a JSON value")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidJSON(f"The number {text[:40]} is out of range")
    return value


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit``, walked without recursion."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def parse_json(raw: bytes | str, what: str = "body") -> Any:
    """``raw`` as JSON, nested at most :data:`MAX_DEPTH` deep.

    Args:
        raw: The bytes (UTF-8) or text received.
        what: How an error message names it ("body", "message").

    Raises:
        InvalidJSON: It is not strict JSON, or nests too deep.
    """
    too_deep = InvalidJSON(f"The {what} nests arrays and objects deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(raw, parse_constant=_constant, parse_float=_float)
    except InvalidJSON as exc:
        raise InvalidJSON(f"The {what} is not valid JSON: {exc.message}") from None
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError):
        raise InvalidJSON(f"The {what} is not valid JSON") from None
    if _too_deep(value, MAX_DEPTH):
        raise too_deep
    return value
