"""The node types request schemas are built of, and the leaf nodes every schema shares.

A node checks one JSON value at a path: :class:`Schema` (any value), :class:`Bool`, :class:`Num` (finite, within a
range), :class:`Int`, :class:`WholeNumber`, :class:`Str` (an enum, a rule), :class:`Arr`, :class:`Obj` (typed
fields, required ones), :class:`OneOf` (a union dispatched on the JSON type) and :class:`Tagged` (an object whose
tag field picks its schema). A failure raises :class:`~lemonkit.errors.InvalidArgument` naming the path
(:func:`invalid_at`); a required top-level field that is missing is the spec's ``missing_argument``. The route
schemas built of them are in :mod:`lemonkit.formats.schemas`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from lemonkit.errors import InvalidArgument, MissingArgument

__all__ = [
    "ANY",
    "BOOL",
    "INT",
    "NUM",
    "OBJ",
    "STR",
    "Any_",
    "Arr",
    "Bool",
    "Int",
    "Num",
    "Obj",
    "OneOf",
    "Schema",
    "Str",
    "Tagged",
    "WholeNumber",
    "invalid_at",
]


#: Python type -> its JSON name, bool before int (Python counts a bool as an int)
_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (type(None), "null"),
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def _json_type(v: object) -> str:
    return next((name for kind, name in _JSON_TYPES if isinstance(v, kind)), type(v).__name__)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def invalid_at(path: str, problem: str) -> InvalidArgument:
    """The error for a value at JSON ``path``: ``messages[1].content: expected string or array, got number``."""
    return InvalidArgument(f"{path}: {problem}")


class Schema:
    """A node: ``check`` raises :class:`InvalidArgument` naming ``path`` or returns None."""

    kind = "value"  # how "expected ..." names it

    def matches(self, v: object) -> bool:
        """Whether ``v`` has this schema's JSON type (unions dispatch on it)."""
        return True

    def check(self, v: object, path: str) -> None:
        if not self.matches(v):
            raise invalid_at(path, f"expected {self.kind}, got {_json_type(v)}")


class Any_(Schema):
    pass


class Bool(Schema):
    kind = "boolean"

    def matches(self, v: object) -> bool:
        return isinstance(v, bool)


class Num(Schema):
    """A finite number; bool is refused although Python counts it as an int."""

    kind = "number"

    def __init__(self, lo: float | None = None, hi: float | None = None) -> None:
        self.lo, self.hi = lo, hi

    def matches(self, v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def check(self, v: object, path: str) -> None:
        super().check(v, path)
        assert isinstance(v, (int, float))
        if isinstance(v, float) and not math.isfinite(v):
            raise invalid_at(path, "expected a finite number")
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            if self.hi is None:
                raise invalid_at(path, f"must be >= {self.lo}, got {v}")
            if self.lo is None:
                raise invalid_at(path, f"must be <= {self.hi}, got {v}")
            raise invalid_at(path, f"must be between {self.lo} and {self.hi}, got {v}")


class Int(Num):
    kind = "integer"

    def matches(self, v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)


class WholeNumber(Num):
    """A whole number, which JSON may also spell ``8192.0``; ``also`` lists values allowed outside ``lo..hi``."""

    kind = "integer"

    def __init__(self, lo: float | None = None, hi: float | None = None, also: tuple[int, ...] = ()) -> None:
        super().__init__(lo, hi)
        self.also = also

    def check(self, v: object, path: str) -> None:
        Schema.check(self, v, path)
        assert isinstance(v, (int, float))
        if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
            raise invalid_at(path, f"expected a whole number, got {v}")
        if v in self.also:
            return
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            allowed = f"between {self.lo} and {self.hi}" + "".join(f" or {x}" for x in self.also)
            raise invalid_at(path, f"must be {allowed}, got {v}")


class Str(Schema):
    """A string, optionally from ``enum`` and/or passed through an extra ``rule``."""

    kind = "string"

    def __init__(self, enum: Iterable[str] | None = None, rule: Callable[[str, str], None] | None = None) -> None:
        self.enum = tuple(enum) if enum is not None else None
        self.rule = rule

    def matches(self, v: object) -> bool:
        return isinstance(v, str)

    def check(self, v: object, path: str) -> None:
        super().check(v, path)
        assert isinstance(v, str)
        if self.enum is not None and v not in self.enum:
            raise invalid_at(path, f"expected one of {', '.join(self.enum)}, got {v[:40]!r}")
        if self.rule is not None:
            self.rule(v, path)


class Arr(Schema):
    kind = "array"

    def __init__(self, item: Schema, min_items: int = 0) -> None:
        self.item, self.min_items = item, min_items

    def matches(self, v: object) -> bool:
        return isinstance(v, list)

    def check(self, v: object, path: str) -> None:
        super().check(v, path)
        assert isinstance(v, list)
        if len(v) < self.min_items:
            raise invalid_at(path, f"expected at least {self.min_items} item{'s' if self.min_items > 1 else ''}")
        item = self.item
        for i, x in enumerate(v):
            item.check(x, f"{path}[{i}]")


class Obj(Schema):
    """An object with typed known fields; ``required`` names those that must be present and not null."""

    kind = "object"

    def __init__(self, fields: dict[str, Schema] | None = None, required: Iterable[str] = ()) -> None:
        self.fields = fields or {}
        self.required = tuple(required)

    def matches(self, v: object) -> bool:
        return isinstance(v, dict)

    def check(self, v: object, path: str) -> None:
        super().check(v, path)
        assert isinstance(v, dict)
        for key in self.required:
            if v.get(key) is None:
                if not path:  # a top-level argument: the spec's missing_argument
                    raise MissingArgument(f"{key}: required argument is missing")
                raise invalid_at(_join(path, key), "required field is missing")
        for key, schema in self.fields.items():
            x = v.get(key)
            if x is not None:
                schema.check(x, _join(path, key))


class OneOf(Schema):
    """A union dispatched on the JSON type: the first alternative whose type matches checks the value."""

    def __init__(self, *alts: Schema) -> None:
        self.alts = alts
        self.kind = " or ".join(a.kind for a in alts)

    def matches(self, v: object) -> bool:
        return any(a.matches(v) for a in self.alts)

    def check(self, v: object, path: str) -> None:
        for a in self.alts:
            if a.matches(v):
                a.check(v, path)
                return
        raise invalid_at(path, f"expected {self.kind}, got {_json_type(v)}")


class Tagged(Obj):
    """An object whose ``key`` field picks its schema among ``variants`` (``default`` when absent)."""

    def __init__(self, key: str, variants: dict[str, Obj], default: str | None = None) -> None:
        super().__init__()
        self.key, self.variants, self.default = key, variants, default

    def check(self, v: object, path: str) -> None:
        Schema.check(self, v, path)
        assert isinstance(v, dict)
        tag = v.get(self.key, self.default)
        if tag is None:
            raise invalid_at(_join(path, self.key), "required field is missing")
        if not isinstance(tag, str) or tag not in self.variants:
            shown = repr(tag[:40]) if isinstance(tag, str) else _json_type(tag)
            raise invalid_at(_join(path, self.key), f"expected one of {', '.join(self.variants)}, got {shown}")
        self.variants[tag].check(v, path)


STR, BOOL, NUM, INT, ANY, OBJ = Str(), Bool(), Num(), Int(), Any_(), Obj()
