"""OpenAI chat messages as plain dicts a chat template can render.

Content parts are flattened to text (images become the vision marker), assistant tool calls get their
arguments parsed (Hermes/Qwen templates ``tojson`` them), and for templates that know no tools, calls and
results become ``<tool_call>`` / ``<tool_response>`` text.
"""

from __future__ import annotations

import json
from typing import Any

from lemonkit.errors import InvalidArgument

__all__ = [
    "THINK_CLOSE",
    "THINK_OPEN",
    "TOOL_CLOSE",
    "TOOL_OPEN",
    "merge_system_messages",
    "normalize_messages",
    "with_system",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"

_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _text_of(content: Any, *, image_marker: str | None, images: list[str] | None) -> str:
    """Flatten OpenAI content (str | None | list of parts) to text; collect image URLs."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument("message content must be a string, null or a list of content parts")
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            raise InvalidArgument("each content part must be an object")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidArgument("a text content part needs a string 'text'")
            texts.append(text)
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise InvalidArgument("an image_url content part needs image_url.url")
            if images is None:
                raise InvalidArgument("this model takes no image input (it was loaded without an mmproj)")
            images.append(url)
            if image_marker:
                texts.append(image_marker)
        else:
            raise InvalidArgument(f"unsupported content part type: {kind!r}")
    # llama.cpp joins the text parts of one message with newlines
    return "\n".join(texts)


def _call_to_template(call: Any) -> dict[str, Any]:
    """An OpenAI assistant tool call, with ``arguments`` parsed: Hermes/Qwen templates ``tojson`` them."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise InvalidArgument("each tool_calls entry needs a 'function' object")
    fn = call["function"]
    name = fn.get("name")
    if not isinstance(name, str):
        raise InvalidArgument("tool_calls[].function.name must be a string")
    args: Any = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # keep the string: the template prints it as is
    return {"id": call.get("id", ""), "type": "function", "function": {"name": name, "arguments": args}}


def normalize_messages(
    messages: Any,
    *,
    tools_in_template: bool = True,
    merge_system: bool = False,
    image_marker: str | None = None,
    images: list[str] | None = None,
) -> list[dict[str, Any]]:
    """OpenAI messages -> plain dicts a chat template can render.

    Args:
        messages: The request's ``messages``.
        tools_in_template: False when the template knows no tools: assistant tool calls become
            ``<tool_call>`` text and tool results become user turns in ``<tool_response>``.
        merge_system: Fold system messages into the first user turn (for formats such as
            Gemma's that have no system role and would drop it).
        image_marker: Text that replaces each image part (multimodal); None drops images.
        images: Receives the URL of each image part; None refuses image parts.

    Raises:
        InvalidArgument: Empty or malformed messages.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("'messages' must be a non-empty array")
    out: list[dict[str, Any]] = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise InvalidArgument("each message must be an object")
        role = msg.get("role")
        if role not in _ROLES:
            raise InvalidArgument(f"unsupported message role: {role!r}")
        if role == "developer":
            role = "system"
        text = _text_of(msg.get("content"), image_marker=image_marker, images=images)
        item: dict[str, Any] = {"role": role, "content": text}
        if role == "assistant" and msg.get("tool_calls"):
            calls = msg["tool_calls"]
            if not isinstance(calls, list):
                raise InvalidArgument("'tool_calls' must be an array")
            parsed = [_call_to_template(c) for c in calls]
            if tools_in_template:
                item["tool_calls"] = parsed
            else:
                blocks = [
                    TOOL_OPEN
                    + "\n"
                    + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                    + "\n"
                    + TOOL_CLOSE
                    for c in parsed
                ]
                item["content"] = "\n".join([text, *blocks] if text else blocks)
        if role == "assistant" and isinstance(msg.get("reasoning_content"), str):
            item["reasoning_content"] = msg["reasoning_content"]
        if role == "tool":
            if tools_in_template:
                if isinstance(msg.get("tool_call_id"), str):
                    item["tool_call_id"] = msg["tool_call_id"]
                if isinstance(msg.get("name"), str):
                    item["name"] = msg["name"]
            else:
                item = {"role": "user", "content": "<tool_response>\n" + text + "\n</tool_response>"}
        out.append(item)
    if merge_system:
        out = merge_system_messages(out)
    return out


def merge_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold system messages into the first user turn (for formats without a system role)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    rest = [m for m in messages if m["role"] != "system"]
    if not system:
        return rest
    for i, m in enumerate(rest):
        if m["role"] == "user":
            rest[i] = {**m, "content": system + "\n\n" + m["content"]}
            return rest
    return [{"role": "user", "content": system}, *rest]


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Prepend ``text`` to the system message (adding one when there is none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": (first["content"] + "\n\n" + text) if first["content"] else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
