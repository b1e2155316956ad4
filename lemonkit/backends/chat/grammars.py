"""GBNF grammars that constrain generation: any JSON object, a JSON schema, ``response_format``, a forced tool call.

Schemas are converted by llama-cpp-python's ``SchemaConverter`` (a port of llama.cpp's converter), with what the port
lacks or gets wrong put right here: integer bounds, backslashes in literals, strict string characters. Bounds on
non-integer numbers are not enforced (llama.cpp's converter does not enforce them either).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from lemonkit.backends.chat.integer_range import integer_bounds, integer_range
from lemonkit.backends.chat.tools import ToolSpec
from lemonkit.errors import InvalidArgument

__all__ = ["json_object_grammar", "json_schema_grammar", "response_format_grammar", "tool_call_grammar"]

# JSON strings may not hold raw control characters, and a bare quote or backslash ends or escapes one, but
# llama.cpp's converter allows control characters in ``char`` and all three in a pattern's ``.``: either lets a
# model write a string that json.loads rejects. Tighten both classes.
_STRICT_CLASS = '[^"\\\\\\x7F\\x00-\\x1F]'
_TIGHTEN = {
    'char ::= [^"\\\\] |': f"char ::= {_STRICT_CLASS} |",
    "dot ::= [^\\x0A\\x0D]": f"dot ::= {_STRICT_CLASS}",
}


def json_object_grammar() -> str:
    """Any JSON object: llama.cpp's ``grammars/json.gbnf`` (strings without raw control characters, bounded
    whitespace), as llama-cpp-python ships it."""
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


@functools.cache
def _converter_class() -> Any:
    from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

    class Converter(SchemaConverter):
        def _format_literal(self, literal: str) -> str:
            # the port escapes quotes, not backslashes: a const or enum holding '"' made a grammar that did not parse
            return str(super()._format_literal(literal.replace("\\", "\\\\")))

        def visit(self, schema: dict[str, Any], name: str) -> str:
            bounds = integer_bounds(schema) if isinstance(schema, dict) else None
            if bounds is None:
                return str(super().visit(schema, name))
            rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
            return str(self._add_rule(rule_name, integer_range(*bounds) + " space"))

    return Converter


def _schema_grammar(schema: dict[str, Any]) -> str:
    converter = _converter_class()(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        # a copy: resolving rewrites each $ref in place, and the request's tools still reach the prompt
        converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), "request"), "")
        gbnf = str(converter.format_grammar())
    except (AssertionError, KeyError, ValueError, TypeError, RecursionError) as exc:
        raise InvalidArgument(f"unsupported JSON schema: {exc!r}") from exc
    for loose, strict in _TIGHTEN.items():
        gbnf = gbnf.replace(loose, strict)
    return gbnf


def json_schema_grammar(schema: Any) -> str:
    """GBNF that only admits JSON documents matching ``schema``."""
    if not isinstance(schema, dict):
        raise InvalidArgument("a JSON schema must be an object")
    if not schema:
        return json_object_grammar()
    return _schema_grammar(schema)


def tool_call_grammar(tools: ToolSpec, name: str | None = None) -> str:
    """GBNF for one call ``{"name": <tool>, "arguments": <its parameters>}``, ``name`` first.

    Restricted to tool ``name`` when given. Each tool's ``$defs``/``definitions`` are hoisted to
    the root so its local ``$ref``s still resolve inside the combined schema.
    """
    names = [name] if name is not None else tools.names
    alternatives: list[dict[str, Any]] = []
    root: dict[str, Any] = {}
    for n in names:
        params = dict(tools.params[n])
        for key in ("$defs", "definitions"):
            if isinstance(params.get(key), dict):
                root.setdefault(key, {}).update(params.pop(key))
        if not params or params == {"type": "object"}:
            params = {"type": "object", "additionalProperties": True}
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": params},
                "required": ["name", "arguments"],
            }
        )
    if len(alternatives) == 1:
        root.update(alternatives[0])
    else:
        root["oneOf"] = alternatives
    return _schema_grammar(root)


def response_format_grammar(response_format: Any) -> str | None:
    """GBNF for ``response_format`` (``text`` -> None, ``json_object``, ``json_schema``).

    Raises:
        InvalidArgument: An unknown type or a ``json_schema`` without a schema.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidArgument("'response_format' must be an object")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema = response_format.get("schema")  # llama.cpp extension: json_object with a schema
        return json_schema_grammar(schema) if isinstance(schema, dict) and schema else json_object_grammar()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None and isinstance(response_format.get("schema"), dict):
            schema = response_format["schema"]
        if not isinstance(schema, dict):
            raise InvalidArgument("response_format json_schema needs json_schema.schema (an object)")
        return json_schema_grammar(schema)
    raise InvalidArgument(f"unsupported response_format type: {kind!r}")
