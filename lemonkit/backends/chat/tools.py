"""Tools: the validated ``tools`` of a request, their declaration for templates that know none, and the
tool calls found in generated JSON."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from typing import Any

from lemonkit.errors import InvalidArgument

__all__ = ["ToolSpec", "new_call_id", "parse_json_calls", "parse_tools", "tool_call_from_obj", "tool_system_prompt"]


def new_call_id(style: str = "openai") -> str:
    """A tool call id: OpenAI's ``call_`` + 24 random hex digits, or with ``style="mistral"`` the 9 letters and
    digits Mistral's templates demand when the call comes back in the history (they refuse any other id)."""
    if style == "mistral":
        alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + secrets.token_hex(12)


class ToolSpec:
    """The validated ``tools`` of a request: name -> parameters schema, in request order."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = tools
        self.params: dict[str, dict[str, Any]] = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    @property
    def names(self) -> list[str]:
        return list(self.params)


def parse_tools(tools: Any) -> ToolSpec | None:
    """Validate OpenAI ``tools``; None when absent or empty.

    Raises:
        InvalidArgument: A tool that is not ``{"type": "function", "function": {"name", ...}}``.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidArgument("'tools' must be an array")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidArgument("each tool must be {'type': 'function', 'function': {...}}")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgument("each tool needs function.name")
        if fn["name"] in seen:
            raise InvalidArgument(f"duplicate tool name {fn['name']!r}")
        seen.add(fn["name"])
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise InvalidArgument(f"tool {fn['name']!r}: 'parameters' must be a JSON schema object")
        clean = {"name": fn["name"], "parameters": params}
        if isinstance(fn.get("description"), str):
            clean["description"] = fn["description"]
        out.append({"type": "function", "function": clean})
    return ToolSpec(out) if out else None


def tool_system_prompt(tools: ToolSpec) -> str:
    """Tool declarations for templates that render none (Hermes wording, which most models know)."""
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
        *(json.dumps(t, ensure_ascii=False) for t in tools.tools),
        "</tools>",
        "",
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "</tool_call>",
    ]
    return "\n".join(lines)


def tool_call_from_obj(obj: Any, names: Iterable[str] | None) -> dict[str, str] | None:
    """``{"name", "arguments"|"parameters"}`` -> ``{"name", "arguments": json string}``, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_json_calls(text: str, names: Iterable[str] | None) -> list[dict[str, str]] | None:
    """One or more JSON objects (optionally in a list) that all name tools, else None."""
    decoder = json.JSONDecoder()
    calls: list[dict[str, str]] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,;":
            i += 1
        if i >= n:
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        for item in items:
            call = tool_call_from_obj(item, names)
            if call is None:
                return None
            calls.append(call)
    return calls or None
