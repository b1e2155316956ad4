"""Prompt rendering and output parsing for chat completions, as pure functions.

Everything here is model-free so it can be unit-tested without weights: OpenAI message
normalisation, Jinja chat-template rendering (HF semantics), tool declarations for templates
that know no tools, GBNF grammars for forced tool calls and ``response_format``, and the
streaming splitters that turn generated text into ``content`` / ``reasoning_content`` /
``tool_calls``. The llama.cpp engine (:mod:`lemonkit.backends.llamacpp`) glues them to a model.

The streaming classes work on the text *delta* of each token and keep at most a tag's length
of text held back, so the per-token cost does not grow with the length of the answer.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from lemonkit.errors import InvalidArgument

__all__ = [
    "JSON_OBJECT_GRAMMAR",
    "ChatTemplate",
    "Event",
    "ForcedToolStream",
    "StopMatcher",
    "StreamParser",
    "ToolSpec",
    "json_schema_grammar",
    "merge_system_messages",
    "new_call_id",
    "normalize_messages",
    "parse_tools",
    "prompt_opens_thinking",
    "response_format_grammar",
    "split_output",
    "tool_call_grammar",
    "tool_system_prompt",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"

#: A parse event: ("content" | "reasoning", text) or ("tool_call", {"name": str, "arguments": str}).
Event = tuple[str, Any]

_ROLES = {"system", "user", "assistant", "tool", "developer"}

# JSON strings may not hold raw control characters: llama.cpp's converter allows them in
# ``char``, which lets a model write a string that json.loads rejects. Tighten the class.
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'

#: Any JSON object (llama.cpp's ``grammars/json.gbnf``, whitespace bounded).
JSON_OBJECT_GRAMMAR = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
""".strip()


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` + 24 random hex digits)."""
    return "call_" + secrets.token_hex(12)


# --------------------------------------------------------------------------- messages


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


# --------------------------------------------------------------------------- templates


class ChatTemplate:
    """A GGUF / HF Jinja chat template, compiled once, rendered like transformers does."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Generation(jinja2.ext.Extension):
            """HF's ``{% generation %}`` marker: render its body unchanged."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                parser.stream.skip(1)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"invalid chat template: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        #: The template declares tools itself (else the engine adds a system prompt).
        self.supports_tools = "tools" in source
        self.supports_thinking = "enable_thinking" in source

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text. Variables left out stay *undefined*, as templates' ``is defined`` tests expect."""
        import jinja2

        ctx: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
        }
        if tools:
            ctx["tools"] = tools
        if enable_thinking is not None:
            ctx["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**ctx)
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"the chat template failed on these messages: {exc}") from exc
        except _TemplateRaised as exc:
            raise InvalidArgument(f"the chat template refused these messages: {exc}") from exc


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the rendered prompt leaves a ``<think>`` open (the model starts inside its reasoning)."""
    i = prompt.rfind(THINK_OPEN)
    return i >= 0 and prompt.rfind(THINK_CLOSE) < i


# --------------------------------------------------------------------------- tools


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


def _schema_grammar(schema: dict[str, Any]) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except (AssertionError, KeyError, ValueError, TypeError, RecursionError) as exc:
        raise InvalidArgument(f"unsupported JSON schema: {exc!r}") from exc
    return gbnf.replace(_LOOSE_CHAR, _STRICT_CHAR)


def json_schema_grammar(schema: Any) -> str:
    """GBNF that only admits JSON documents matching ``schema``."""
    if not isinstance(schema, dict):
        raise InvalidArgument("a JSON schema must be an object")
    if not schema:
        return JSON_OBJECT_GRAMMAR
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
        return json_schema_grammar(schema) if isinstance(schema, dict) and schema else JSON_OBJECT_GRAMMAR
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None and isinstance(response_format.get("schema"), dict):
            schema = response_format["schema"]
        if not isinstance(schema, dict):
            raise InvalidArgument("response_format json_schema needs json_schema.schema (an object)")
        return json_schema_grammar(schema)
    raise InvalidArgument(f"unsupported response_format type: {kind!r}")


def _tool_call_from_obj(obj: Any, names: Iterable[str] | None) -> dict[str, str] | None:
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


def _parse_json_calls(text: str, names: Iterable[str] | None) -> list[dict[str, str]] | None:
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
            call = _tool_call_from_obj(item, names)
            if call is None:
                return None
            calls.append(call)
    return calls or None


# --------------------------------------------------------------------------- streaming


_JSON_CALL_START = re.compile(r'\s*\{\s*"name"\s*:')
# Text that can still grow into _JSON_CALL_START.
_JSON_CALL_PREFIX = re.compile(r'\s*\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?')


def _partial_tag_start(text: str, tags: tuple[str, ...]) -> int:
    """Index where a suffix of ``text`` that could start one of ``tags`` begins, else len(text).

    Only the last ``max(len(tag)) - 1`` characters are looked at: cost is independent of ``text``.
    """
    n = len(text)
    longest = max(len(t) for t in tags)
    start = max(0, n - longest + 1)
    i = text.find("<", start)
    while i >= 0:
        tail = text[i:]
        if any(t.startswith(tail) for t in tags):
            return i
        i = text.find("<", i + 1)
    return n


def _trailing_hold(text: str, tags: tuple[str, ...]) -> int:
    """Like :func:`_partial_tag_start`, also holding the whitespace before it (stripped at a tag)."""
    k = _partial_tag_start(text, tags)
    while k > 0 and text[k - 1] in " \t\r\n":
        k -= 1
    return k


class StopMatcher:
    """Cuts generated text at the first stop string; holds back text that may start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text safe to emit now (stop strings and what follows them never are)."""
        if not self.stops or self.stopped:
            return "" if self.stopped else text
        buf = self._held + text
        # Only the held tail plus the new text can contain a new match.
        cut = -1
        for s in self.stops:
            j = buf.find(s)
            if j >= 0 and (cut < 0 or j < cut):
                cut = j
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


class StreamParser:
    """Splits generated text into reasoning, content and tool calls as it streams.

    ``<think>…</think>`` goes to reasoning (also when the prompt opened the tag, see
    ``in_reasoning``); with ``tool_names`` (tool_choice ``auto``), ``<tool_call>{json}</tool_call>``
    blocks and an answer that is a bare JSON object naming a tool become tool calls. Text that
    might be the start of a tag is held back until it is decided; an answer that starts with
    ``{`` is held until the end when tools are on (it may be a bare tool call).
    """

    def __init__(self, *, in_reasoning: bool = False, tool_names: list[str] | None = None) -> None:
        self._mode = "reasoning" if in_reasoning else "content"
        self._names = tool_names
        self._tags: tuple[str, ...] = (THINK_OPEN, TOOL_OPEN) if tool_names else (THINK_OPEN,)
        self._buf = ""
        self._any_content = False
        self._json_checked = False  # the answer's start was checked for a bare JSON tool call
        self._json_call = False
        # Whitespace between a tag and the text it frames is formatting, not output (as llama-server).
        self._strip_content = False
        self._strip_reasoning = in_reasoning

    def _emit(self, kind: str, text: str, out: list[Event]) -> None:
        if kind == "content":
            if self._strip_content:
                text = text.lstrip()
                if not text:
                    return
                self._strip_content = False
            if not text:
                return
            self._any_content = True
        else:
            if self._strip_reasoning:
                text = text.lstrip()
                if not text:
                    return
                self._strip_reasoning = False
            if not text:
                return
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def feed(self, text: str) -> list[Event]:
        """Events decided by this delta (often one; empty while text is held back)."""
        if not self._buf and self._mode == "content" and not self._names and not self._strip_content:
            if "<" not in text:  # the common case, kept cheap: plain answer text
                return [("content", text)] if text else []
        out: list[Event] = []
        self._buf += text
        while self._buf:
            buf = self._buf
            if self._mode == "reasoning":
                j = buf.find(THINK_CLOSE)
                if j >= 0:
                    self._emit("reasoning", buf[:j].rstrip(), out)
                    self._buf = buf[j + len(THINK_CLOSE) :]
                    self._mode = "content"
                    self._strip_content = True
                    continue
                # Hold back a partial tag, and whitespace that may turn out to precede the tag.
                k = _trailing_hold(buf, (THINK_CLOSE,))
                self._emit("reasoning", buf[:k], out)
                self._buf = buf[k:]
                return out
            if self._mode == "tool":
                j = buf.find(TOOL_CLOSE)
                if j < 0:
                    return out
                self._tool_block(buf[:j], out)
                self._buf = buf[j + len(TOOL_CLOSE) :]
                self._mode = "content"
                self._strip_content = True
                continue
            if self._mode == "json":
                # An answer opening with '{"name"' may be a bare tool call: hold it to the end.
                # Anything else is an ordinary (JSON) answer and streams from here on.
                if self._json_call or _JSON_CALL_START.match(buf):
                    self._json_call = True
                    return out
                if _JSON_CALL_PREFIX.fullmatch(buf):
                    return out
                self._mode = "content"
                self._json_checked = True
                continue
            # content
            if self._names and not self._any_content and not self._json_checked:
                stripped = buf.lstrip()
                if not stripped:
                    return out
                if stripped[0] == "{":
                    self._mode = "json"
                    continue
                self._json_checked = True
            if "<" not in buf:  # fast path: no tag can start here
                k = _trailing_hold(buf, self._tags) if self._names else len(buf)
                self._emit("content", buf[:k], out)
                self._buf = buf[k:]
                return out
            j_think = buf.find(THINK_OPEN)
            j_tool = buf.find(TOOL_OPEN) if self._names else -1
            hits = [(j, t) for j, t in ((j_think, THINK_OPEN), (j_tool, TOOL_OPEN)) if j >= 0]
            if hits:
                j, tag = min(hits)
                self._emit("content", buf[:j].rstrip() if tag == TOOL_OPEN else buf[:j], out)
                self._buf = buf[j + len(tag) :]
                self._mode = "reasoning" if tag == THINK_OPEN else "tool"
                self._strip_reasoning = tag == THINK_OPEN
                continue
            k = _trailing_hold(buf, self._tags) if self._names else _partial_tag_start(buf, self._tags)
            self._emit("content", buf[:k], out)
            self._buf = buf[k:]
            return out
        return out

    def _tool_block(self, body: str, out: list[Event]) -> None:
        calls = _parse_json_calls(body, None)
        if calls is None:
            self._emit("content", TOOL_OPEN + body + TOOL_CLOSE, out)
        else:
            out.extend(("tool_call", c) for c in calls)

    def finish(self) -> list[Event]:
        """Flush what was held back at the end of generation."""
        out: list[Event] = []
        buf, self._buf = self._buf, ""
        if self._mode == "reasoning":
            self._emit("reasoning", buf.rstrip(), out)
        elif self._mode == "tool":
            calls = _parse_json_calls(buf, None)  # a call cut off before </tool_call>
            if calls is None:
                self._emit("content", TOOL_OPEN + buf, out)
            else:
                out.extend(("tool_call", c) for c in calls)
        elif self._mode == "json":
            calls = _parse_json_calls(buf, self._names)
            if calls is None:
                self._emit("content", buf, out)
            else:
                out.extend(("tool_call", c) for c in calls)
        else:
            self._emit("content", buf, out)
        return out


def split_output(text: str, *, in_reasoning: bool = False, tool_names: list[str] | None = None) -> list[Event]:
    """Non-streaming :class:`StreamParser`: the events of a whole answer, merged by kind."""
    parser = StreamParser(in_reasoning=in_reasoning, tool_names=tool_names)
    events = parser.feed(text) + parser.finish()
    merged: list[Event] = []
    for kind, value in events:
        if kind != "tool_call" and merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return merged


_NAME_RE = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class ForcedToolStream:
    """Streams a grammar-forced ``{"name": ..., "arguments": {...}}`` as OpenAI tool-call parts.

    Emits ("tool_name", name) once the name is complete, then ("tool_args", text) pieces of the
    arguments object. The grammar fixes the shape, so the arguments end where the outer object
    does: trailing ``}``/whitespace is held back until more text or the end shows which is which.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._name: str | None = None
        self._args_start = 0
        self._sent = 0  # chars of the arguments already emitted

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        if self._name is None:
            m = _NAME_RE.match(self._buf)
            if m is None:
                return out
            self._name = json.loads(m.group(1))
            self._args_start = m.end()
            out.append(("tool_name", self._name))
        buf = self._buf
        if self._sent == 0:  # whitespace the grammar allows before the arguments is not part of them
            while self._args_start < len(buf) and buf[self._args_start] in " \t\r\n":
                self._args_start += 1
        # Index arithmetic over the buffer: no per-token copy of the arguments so far.
        sent_end = self._args_start + self._sent
        end = len(buf)
        while end > sent_end and buf[end - 1] in " \t\r\n}":
            end -= 1
        if end > sent_end:
            out.append(("tool_args", buf[sent_end:end]))
            self._sent = end - self._args_start
        return out

    def finish(self) -> tuple[list[Event], dict[str, str] | None]:
        """The last events and the whole call (None when the output is not a complete call)."""
        out: list[Event] = []
        try:
            obj = json.loads(self._buf)
        except ValueError:
            obj = None
        call = _tool_call_from_obj(obj, None)
        if self._name is not None:
            tail = self._buf[self._args_start :].rstrip()
            tail = tail[:-1].rstrip() if call is not None and tail.endswith("}") else tail
            if len(tail) > self._sent:
                out.append(("tool_args", tail[self._sent :]))
                self._sent = len(tail)
        return out, call
