"""GBNF for the integers of a JSON schema's ``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum``.

llama.cpp's converter bounds integers this way; llama-cpp-python's port of it ignores the bounds (a TODO), so a
grammar from it lets ``{"age": -7}`` through a ``"minimum": 0``.
"""

from __future__ import annotations

import math
from typing import Any

from lemonkit.errors import InvalidArgument

__all__ = ["integer_bounds", "integer_range"]

#: digits of the longest integer, as llama.cpp's ``integral-part`` allows
MAX_DIGITS = 16


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None] | None:
    """``(lowest, highest)`` allowed (None: unbounded) for a bounded integer schema, else None.

    Raises:
        InvalidArgument: Bounds that are not numbers, or that leave no integer.
    """
    keys = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
    if schema.get("type") != "integer" or not any(k in schema for k in keys):
        return None
    if any(k in schema for k in ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")):
        return None  # the converter's own branch decides: the value is spelled out
    for key in keys:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value)):
            raise InvalidArgument(f"unsupported JSON schema: {key} must be a number, got {value!r}")
    lows = [math.ceil(schema["minimum"])] if "minimum" in schema else []
    lows += [math.floor(schema["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in schema else []
    highs = [math.floor(schema["maximum"])] if "maximum" in schema else []
    highs += [math.ceil(schema["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in schema else []
    lo, hi = max(lows, default=None), min(highs, default=None)
    if lo is not None and hi is not None and lo > hi:
        raise InvalidArgument(f"unsupported JSON schema: no integer lies between its bounds ({lo} > {hi})")
    return lo, hi


def integer_range(lo: int | None, hi: int | None) -> str:
    """A GBNF expression for the integers from ``lo`` to ``hi`` (None: unbounded), written as JSON writes them."""
    parts = []
    if lo is None or lo < 0:
        nearest = 1 if hi is None or hi >= 0 else -hi  # the smallest magnitude of a negative number allowed
        parts.append('"-" ' + _group(_naturals(nearest, None if lo is None else -lo)))
    if hi is None or hi >= 0:
        parts.append(_naturals(max(lo or 0, 0), hi))
    return _group(" | ".join(parts))


def _naturals(a: int, b: int | None) -> str:
    """``a`` to ``b`` (None: any longer number, up to :data:`MAX_DIGITS` digits), without leading zeros."""
    width = len(str(a))
    top = b if b is not None else 10**width - 1
    parts = []
    lo = a
    while lo <= top:
        hi = min(top, 10 ** len(str(lo)) - 1)
        parts.append(_same_width(str(lo), str(hi)))
        lo = hi + 1
    if b is None and width < MAX_DIGITS:
        parts.append(f"[1-9] [0-9]{{{width},{MAX_DIGITS - 1}}}")
    return " | ".join(parts)


def _same_width(lo: str, hi: str) -> str:
    """The digit strings from ``lo`` to ``hi``, both of one width."""
    if lo == hi:
        return f'"{lo}"'
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return f'"{lo[0]}" ' + _group(_same_width(lo[1:], hi[1:]))
    rest = len(lo) - 1
    first, last = int(lo[0]), int(hi[0])
    parts = []
    if lo[1:] != "0" * rest:  # lo's leading digit, then from lo's tail up
        parts.append(f'"{lo[0]}" ' + _group(_same_width(lo[1:], "9" * rest)))
        first += 1
    tail = None
    if hi[1:] != "9" * rest:  # hi's leading digit, then up to hi's tail
        tail = f'"{hi[0]}" ' + _group(_same_width("0" * rest, hi[1:]))
        last -= 1
    if first <= last:
        parts.append(f"[{first}-{last}] [0-9]{{{rest}}}")
    if tail is not None:
        parts.append(tail)
    return " | ".join(parts)


def _group(expr: str) -> str:
    return f"({expr})" if " | " in expr else expr
