"""Integer bounds of JSON schemas as GBNF: checked exhaustively near the bounds, through an equivalent regex."""

from __future__ import annotations

import random
import re

import pytest

from lemonkit.backends.chat.integer_range import MAX_DIGITS, integer_bounds, integer_range
from lemonkit.errors import InvalidArgument


def _regex(gbnf: str) -> re.Pattern[str]:
    """The GBNF this module writes (literals, classes, repetitions, groups, alternatives) as a Python regex."""
    return re.compile(re.sub(r'"([^"]*)"', lambda m: re.escape(m.group(1)), gbnf).replace(" ", ""))


RANGES = [
    (0, None),
    (5, None),
    (-5, None),
    (None, 0),
    (None, -3),
    (None, 120),
    (-17, 42),
    (0, 0),
    (7, 7),
    (-20, -3),
    (10, 99),
    (100, 1000),
    (123, 4567),
    (-1000, -999),
    (1, 10**6),
    (-(10**9) + 7, 10**12 - 3),
]


@pytest.mark.parametrize(("lo", "hi"), RANGES)
def test_integer_range_admits_exactly_the_range(lo: int | None, hi: int | None) -> None:
    pattern = _regex(integer_range(lo, hi))
    rng = random.Random(0)
    edges = [b + d for b in (lo, hi, 0) if b is not None for d in range(-1200, 1200)]
    samples = edges + [rng.randint(-(10**15), 10**15) for _ in range(2000)] + [10**15 - 1, -(10**15) + 1]
    for n in samples:
        inside = (lo is None or n >= lo) and (hi is None or n <= hi) and len(str(abs(n))) <= MAX_DIGITS
        assert bool(pattern.fullmatch(str(n))) == inside, (lo, hi, n)
    for spelling in ("-0", "007", "01", "+1", "1.0", ""):
        assert not pattern.fullmatch(spelling)


def test_integer_bounds() -> None:
    assert integer_bounds({"type": "integer"}) is None
    assert integer_bounds({"type": "number", "minimum": 0}) is None
    assert integer_bounds({"type": "integer", "enum": [1, 2], "minimum": 0}) is None
    assert integer_bounds({"type": "integer", "minimum": 0}) == (0, None)
    assert integer_bounds({"type": "integer", "minimum": 1.5, "maximum": 10.7}) == (2, 10)
    assert integer_bounds({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 10}) == (4, 9)
    assert integer_bounds({"type": "integer", "minimum": 5, "exclusiveMinimum": 6, "maximum": 9}) == (7, 9)
    for bad in ({"minimum": 3, "maximum": 2}, {"exclusiveMinimum": 1, "exclusiveMaximum": 2}, {"minimum": True}):
        with pytest.raises(InvalidArgument):
            integer_bounds({"type": "integer", **bad})
