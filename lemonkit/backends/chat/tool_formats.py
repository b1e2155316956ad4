"""Tool-call and reasoning formats of the model families, detected from the model's own chat template.

A :class:`ChatFormat` names the markers one family writes: where reasoning starts and ends, which markers open a
tool-call section and how the calls inside are spelled. :func:`detect_format` reads them off the template (the
template shows the model how its calls look, so a renamed or fine-tuned GGUF still gets its format).

The sections parse incrementally: each keeps its text and a position, and every state either advances or waits
for more text, so a call's id and name go out as soon as they are complete and its arguments as they are written.

Families (the spelling a model writes after its prompt):

- ``hermes`` (Qwen2.5/Qwen3, SmolLM3, Granite, Hermes): ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``;
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5+, Nemotron 3): ``<tool_call><function=NAME><parameter=K>V</parameter>..``;
- ``glm`` (GLM 4.5+): ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``;
- ``llama3`` (Llama 3.x): a bare ``{"name": .., "parameters": {..}}`` reply, or ``<|python_tag|>`` and JSON;
- ``mistral`` (Mistral, Devstral, Magistral): ``[TOOL_CALLS]NAME[ARGS]{..}`` or ``[TOOL_CALLS][{..}, ..]``,
  reasoning in ``[THINK]..[/THINK]``;
- ``lfm2`` (Liquid LFM2): ``<|tool_call_start|>[name(key="v", n=1)]<|tool_call_end|>`` (Python call syntax);
- ``phi4`` (Phi-4-mini): ``<|tool_call|>[{"name": .., "arguments": {..}}]<|/tool_call|>``;
- ``deepseek`` (DeepSeek R1 and V3.1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>..<｜tool▁sep｜>..``;
- ``gemma4`` (Gemma 4): ``<|tool_call>call:NAME{key:<|"|>v<|"|>,n:1}<tool_call|>``, reasoning in a thought channel;
- ``harmony`` (gpt-oss): channels, ``analysis`` reasoning, ``final`` content, ``to=functions.NAME`` calls.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from lemonkit.backends.chat.tools import ToolSpec, tool_call_from_obj

__all__ = ["FORMATS", "ChatFormat", "HarmonyParser", "detect_format", "section_for"]

#: A parse event: ("content" | "reasoning", text), ("tool_name", name) that opens a call, or ("tool_args", piece)
#: of the open call's arguments (a JSON object written out in pieces).
Event = tuple[str, Any]

DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
GEMMA_QUOTE = '<|"|>'


@dataclass(frozen=True)
class ChatFormat:
    """One family's markers: reasoning tags, tool-call section openers, special tokens the parser reads."""

    name: str
    #: reasoning open and close tags (None: the family has none, or it is not tag-delimited)
    think: tuple[str, str] | None = ("<think>", "</think>")
    #: markers that open a tool-call section (each maps to its section parser in :func:`section_for`)
    openers: tuple[str, ...] = ("<tool_call>",)
    #: special tokens the output's markup is made of: the engine renders them as text for the parser
    preserved: tuple[str, ...] = ()
    #: how call ids look (:func:`~lemonkit.backends.chat.tools.new_call_id`): Mistral templates want 9 characters
    call_ids: str = "openai"

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(self.preserved) + (self.think or ()) + self.openers


FORMATS: dict[str, ChatFormat] = {
    f.name: f
    for f in (
        ChatFormat("hermes", preserved=("<tool_call>", "</tool_call>")),
        ChatFormat("qwen3_coder", preserved=("<tool_call>", "</tool_call>")),
        ChatFormat("glm", preserved=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>")),
        ChatFormat("llama3", think=None, openers=("<|python_tag|>",), preserved=("<|python_tag|>",)),
        ChatFormat(
            "mistral",
            think=("[THINK]", "[/THINK]"),
            openers=("[TOOL_CALLS]",),
            preserved=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"),
            call_ids="mistral",
        ),
        ChatFormat(
            "lfm2",
            openers=("<|tool_call_start|>",),
            preserved=("<|tool_call_start|>", "<|tool_call_end|>"),
        ),
        ChatFormat("phi4", openers=("<|tool_call|>",), preserved=("<|tool_call|>", "<|/tool_call|>")),
        ChatFormat(
            "deepseek",
            openers=(DS_CALLS_BEGIN,),
            preserved=(DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP),
        ),
        ChatFormat(
            "gemma4",
            think=("<|channel>thought", "<channel|>"),
            openers=("<|tool_call>",),
            preserved=("<|tool_call>", "<tool_call|>", GEMMA_QUOTE, "<|channel>", "<channel|>"),
        ),
        ChatFormat(
            "harmony",
            think=None,
            openers=(),
            preserved=("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>", "<|call|>"),
        ),
    )
}


def detect_format(template: str | None) -> ChatFormat:
    """The family whose markup the chat template teaches (Hermes when it shows none: the fallback tool prompt
    is Hermes's)."""
    t = template or ""
    if "<|channel|>" in t and "<|message|>" in t:
        return FORMATS["harmony"]
    if "<|tool_call>" in t or GEMMA_QUOTE in t:
        return FORMATS["gemma4"]
    if "<function=" in t:
        return FORMATS["qwen3_coder"]
    if "<arg_key>" in t:
        return FORMATS["glm"]
    if "<|tool_call_start|>" in t or "<|tool_list_start|>" in t:
        return FORMATS["lfm2"]
    if "<|tool_call|>" in t:
        return FORMATS["phi4"]
    if "tool▁calls▁begin" in t:
        return FORMATS["deepseek"]
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t):
        return FORMATS["llama3"]
    return FORMATS["hermes"]


# ----------------------------------------------------------------------------- scanning helpers

_WS = " \t\r\n"
_NAME = re.compile(r"[A-Za-z_][\w.\-:]*")  # a function name
_JSON_STOP = re.compile(r'["\\{}\[\]]')
_STR_STOP = re.compile(r'["\\]')
_PY_STOP = re.compile(r"[\"'\\(){}\[\],]")


class _JsonEnd:
    """Finds where the JSON value starting at ``start`` ends, resuming where the last scan stopped."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.depth = 0
        self.in_str = False
        self.scalar = False  # a bare number / literal: ends at a delimiter

    def scan(self, buf: str) -> int | None:
        """The index just past the value, or None while it is still open."""
        n = len(buf)
        i = self.pos
        if i == self.start and i < n and buf[i] not in '{["' and self.depth == 0:
            self.scalar = True
        if self.scalar:
            m = re.compile(r"[,}\]\s]").search(buf, i)
            if m is None:
                self.pos = n
                return None
            return m.start()
        while i < n:
            if self.in_str:
                m = _STR_STOP.search(buf, i)
                if m is None:
                    i = n
                    break
                j = m.start()
                if buf[j] == "\\":
                    if j + 1 >= n:
                        i = j  # the escaped character has not come yet
                        break
                    i = j + 2
                    continue
                self.in_str = False
                i = j + 1
                if self.depth == 0:
                    self.pos = i
                    return i
                continue
            m = _JSON_STOP.search(buf, i)
            if m is None:
                i = n
                break
            j, c = m.start(), buf[m.start()]
            i = j + 1
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.pos = i
                    return i
        self.pos = i
        return None


def _py_value_end(buf: str, start: int) -> int | None:
    """Index of the top-level ``,`` or ``)`` that ends the Python literal starting at ``start`` (None: not yet)."""
    depth, i, n, quote = 0, start, len(buf), ""
    while i < n:
        if quote:
            j = buf.find(quote, i)
            k = buf.find("\\", i)
            if 0 <= k < (j if j >= 0 else n):
                i = k + 2
                continue
            if j < 0:
                return None
            quote, i = "", j + 1
            continue
        m = _PY_STOP.search(buf, i)
        if m is None:
            return None
        j, c = m.start(), buf[m.start()]
        if c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return j if c == ")" else None
            depth -= 1
        elif c == "," and depth == 0:
            return j
        i = j + 1
    return None


def _partial(buf: str, i: int, literal: str) -> bool | None:
    """``buf[i:]`` starts with ``literal`` (True), could still grow into it (None), or cannot (False)."""
    tail = buf[i : i + len(literal)]
    if tail == literal:
        return True
    return None if literal.startswith(tail) else False


def _skip_ws(buf: str, i: int) -> int:
    n = len(buf)
    while i < n and buf[i] in _WS:
        i += 1
    return i


def _hold_partial(buf: str, start: int, end: int, markers: tuple[str, ...]) -> int:
    """The index from which ``buf[start:end]`` ends with a prefix of one of ``markers`` (``end`` when none)."""
    longest = max(len(m) for m in markers)
    for k in range(max(start, end - longest + 1), end):
        tail = buf[k:end]
        if any(m.startswith(tail) for m in markers):
            return k
    return end


def _json_string(buf: str, i: int) -> tuple[str, int] | Literal[False] | None:
    """A JSON string at ``i``: ``(value, end)``; None while incomplete; False when there is no string."""
    if i >= len(buf):
        return None
    if buf[i] != '"':
        return False
    j = i + 1
    while True:
        m = _STR_STOP.search(buf, j)
        if m is None:
            return None
        k = m.start()
        if buf[k] == "\\":
            j = k + 2
            continue
        try:
            return json.loads(buf[i : k + 1]), k + 1
        except ValueError:
            return False


# ----------------------------------------------------------------------------- sections


class Section:
    """One tool-call section after its opener: ``feed`` text, collect events; ``done`` once it has ended, then
    ``rest`` is the text that followed it. ``failed``: it turned out not to be a call (``raw`` is its text)."""

    close: str | None = None  # the marker that ends the section, if the format has one
    initial: str = ""  # the state a section starts in

    def __init__(self, opener: str, tools: ToolSpec | None) -> None:
        self.opener = opener
        self.tools = tools
        self.buf = ""
        self.i = 0
        self.out: list[Event] = []
        self.done = False
        self.failed = False
        self.calls = 0
        self.n_args = 0  # arguments written of the open call (formats that spell them one by one)
        self.state = self.initial
        self.scan: _JsonEnd | None = None  # where JSON arguments being streamed end (see _start_json_args)
        self.sent = 0  # characters of them written

    def feed(self, text: str, *, final: bool = False) -> list[Event]:
        self.buf += text
        while not self.done and self._step(final):
            pass
        if final and not self.done:  # the text ended inside the section: all of it was the section's
            self._finish()
            self.done = True
            self.i = len(self.buf)
        out, self.out = self.out, []
        return out

    @property
    def rest(self) -> str:
        return self.buf[self.i :] if self.done and not self.failed else ""

    @property
    def raw(self) -> str:
        return self.opener + self.buf

    def _step(self, final: bool) -> bool:
        """Advance as far as the text allows: True when a state changed (run again), False to wait for text."""
        raise NotImplementedError

    def _finish(self) -> None:
        """The text ended inside the section: close what is open."""

    def _fail(self) -> bool:
        """Not a call after all: the section's text is content (only before anything was emitted)."""
        if self.calls:
            self.done = True  # a later malformed part: what came is kept, the rest ends the section
            return False
        self.failed = self.done = True
        return False

    def _to(self, i: int, state: str | None = None) -> bool:
        """Move on to ``i`` (and ``state``): a step was taken, run again."""
        self.i = i
        if state is not None:
            self.state = state
        return True

    def _name(self, name: str) -> None:
        self.calls += 1
        self.n_args = 0
        self.out.append(("tool_name", name))

    def _arg(self, key: str, value: str) -> None:
        """One argument of the open call, as JSON: the object opens with the first (``value`` may be only the
        opening quote of a string that streams on)."""
        self._args(("{" if self.n_args == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": " + value)
        self.n_args += 1

    def _end_args(self) -> None:
        self._args("}" if self.n_args else "{}")

    def _start_json_args(self, i: int) -> bool:
        """The arguments are a JSON value at ``i``: stream it (state ``args``) until :class:`_JsonEnd` finds its end."""
        self.scan = _JsonEnd(i)
        self.sent = 0
        return self._to(i, "args")

    def _json_args(self) -> int | None:
        """Write what came of the JSON arguments; the index just past them once they are whole."""
        assert self.scan is not None
        end = self.scan.scan(self.buf)
        stop = end if end is not None else len(self.buf)
        self._args(self.buf[self.scan.start + self.sent : stop])
        self.sent = stop - self.scan.start
        return end

    def _args(self, piece: str) -> None:
        if piece:
            self.out.append(("tool_args", piece))

    def _end_marker(self, final: bool) -> bool:
        """After the calls: consume the close marker (and whitespace before it), else end here."""
        j = _skip_ws(self.buf, self.i)
        if self.close is None:
            self.done = True
            return False
        hit = _partial(self.buf, j, self.close)
        if hit is None and not final:
            return False
        if hit:
            self.i = j + len(self.close)
        self.done = True
        return False

    def _param_type(self, name: str, key: str) -> str | None:
        params = self.tools.params.get(name) if self.tools is not None else None
        prop = (params or {}).get("properties", {}).get(key) if isinstance(params, dict) else None
        kind = prop.get("type") if isinstance(prop, dict) else None
        return kind if isinstance(kind, str) else None


class JsonCalls(Section):
    """JSON call objects: ``{"name": .., "arguments"|"parameters": {..}}``, one, several, or in a ``[..]`` list.

    The name goes out once its string is complete, then the arguments as they come. An object whose first key is
    not ``name`` is held until it ends and read whole. ``bare``: the reply itself opened with ``{`` (no marker):
    only a call to one of the request's tools counts, else it is all content.
    """

    def __init__(self, opener: str, tools: ToolSpec | None, close: str | None = None, *, bare: bool = False) -> None:
        super().__init__(opener, tools)
        self.close = close
        self.bare = bare
        self.state = "start"
        self.in_list = False

    def _step(self, final: bool) -> bool:
        buf = self.buf
        i = _skip_ws(buf, self.i)
        if self.state == "start":
            if i >= len(buf):
                return False
            if buf[i] == "[":
                self.in_list = True
                self.i = i + 1
            self.state = "object"
            return True
        if self.state == "object":
            return self._object(_skip_ws(buf, self.i), final)
        if self.state == "args":
            end = self._json_args()
            return False if end is None else self._to(end, "close_object")
        if self.state == "close_object":
            if i >= len(buf):
                return False
            if buf[i] == "}":
                self.i = i + 1
            else:  # more keys after the arguments ("id", ...): skip to the object's end
                scan = _JsonEnd(i)
                scan.depth = 1
                end = scan.scan(buf)
                if end is None:
                    return False
                self.i = end
            self.state = "between"
            return True
        if self.state == "whole":
            assert self.scan is not None
            end = self.scan.scan(buf)
            if end is None:
                return False
            try:
                obj = json.loads(buf[self.scan.start : end])
            except ValueError:
                return self._fail()
            call = tool_call_from_obj(obj, self.tools.names if self.bare and self.tools else None)
            if call is None:
                return self._fail()
            self._name(call["name"])
            self._args(call["arguments"])
            return self._to(end, "between")
        # between calls
        if i >= len(buf):
            return False
        c = buf[i]
        if c in ",;":
            return self._to(i + 1)
        if c == "]" and self.in_list:
            self.i = i + 1
            return self._end_marker(final)
        if c == "{":
            return self._to(i, "object")
        self.i = i
        return self._end_marker(final)

    def _object(self, i: int, final: bool) -> bool:
        buf = self.buf
        if i >= len(buf):
            return False
        if buf[i] != "{":
            return self._fail()
        # {"name": "<name>", "arguments": ... with whitespace anywhere
        j = _skip_ws(buf, i + 1)
        key = _json_string(buf, j)
        if key is None:
            return False
        if key is False or key[0] != "name":
            return self._fail() if self.bare else self._whole(i)
        j = _skip_ws(buf, key[1])
        if j >= len(buf):
            return False
        if buf[j] != ":":
            return self._fail()
        name = _json_string(buf, _skip_ws(buf, j + 1))
        if name is None:
            return False
        if name is False:
            return self._fail()
        if self.bare and (self.tools is None or name[0] not in self.tools.params):
            return self._fail()
        j = _skip_ws(buf, name[1])
        if j >= len(buf):
            return False
        if buf[j] == "}":  # a call without arguments
            self._name(name[0])
            self._args("{}")
            return self._to(j + 1, "between")
        if buf[j] != ",":
            return self._fail()
        j = _skip_ws(buf, j + 1)
        key = _json_string(buf, j)
        if key is None:
            return False
        if key is False or key[0] not in ("arguments", "parameters"):
            return self._whole(i)
        j = _skip_ws(buf, key[1])
        if j >= len(buf):
            return False
        if buf[j] != ":":
            return self._fail()
        j = _skip_ws(buf, j + 1)
        if j >= len(buf):
            return False
        if buf[j] == '"':  # arguments as a JSON string: decoded when complete
            s = _json_string(buf, j)
            if s is None:
                return False
            if s is False:
                return self._fail()
            self._name(name[0])
            try:
                args = json.loads(s[0]) if s[0].strip() else {}
            except ValueError:
                args = None
            self._args(json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else s[0])
            return self._to(s[1], "close_object")
        if buf[j] != "{":
            return self._fail()
        self._name(name[0])
        return self._start_json_args(j)

    def _whole(self, i: int) -> bool:
        self.scan = _JsonEnd(i)
        self.state = "whole"
        return True

    def _finish(self) -> None:
        if self.state == "whole" or (self.state == "object" and not self.calls):
            self.failed = True


class NamedJson(Section):
    """``NAME<sep>{json}`` calls: Mistral's ``[TOOL_CALLS]NAME[ARGS]{..}`` and DeepSeek's call blocks."""

    def __init__(
        self, opener: str, tools: ToolSpec | None, sep: str, *, close: str | None = None, call_end: str | None = None
    ) -> None:
        super().__init__(opener, tools)
        self.sep = sep
        self.close = close
        self.call_end = call_end
        self.state = "name"

    def _step(self, final: bool) -> bool:
        buf = self.buf
        if self.state == "name":
            j = buf.find(self.sep, self.i)
            if j < 0:
                if len(buf) - self.i > 256 or final:
                    return self._fail()
                return False
            name = buf[self.i : j]
            name = name.split("[CALL_ID]", 1)[0].strip()
            if not name or any(c in name for c in "{}[]<>\n"):
                return self._fail()
            self._name(name)
            return self._to(j + len(self.sep), "args_start")
        if self.state == "args_start":
            j = _skip_ws(buf, self.i)
            if buf.startswith("[CALL_ID]", j):  # Mistral Small 3.2 writes an id before [ARGS]
                k = buf.find("[ARGS]", j)
                if k < 0:
                    return False
                j = _skip_ws(buf, k + len("[ARGS]"))
            if j >= len(buf):
                return False
            if buf[j] != "{":
                self._args("{}")
                return self._to(j, "after")
            return self._start_json_args(j)
        if self.state == "args":
            end = self._json_args()
            return False if end is None else self._to(end, "after")
        return self._after(final)

    def _after(self, final: bool) -> bool:
        j = _skip_ws(self.buf, self.i)
        if self.call_end is None:
            self.i = j
            self.done = True
            return False
        hit = _partial(self.buf, j, self.call_end)
        if hit is None and not final:
            return False
        if hit:
            j = _skip_ws(self.buf, j + len(self.call_end))
        self.i = j
        return self._next_call(final)

    def _next_call(self, final: bool) -> bool:
        return self._end_marker(final)


class DeepSeekCalls(NamedJson):
    """``<｜tool▁calls▁begin｜>`` then calls ``<｜tool▁call▁begin｜>[function<｜tool▁sep｜>]NAME[<｜tool▁sep｜>]
    [```json] {..} [```]<｜tool▁call▁end｜>``, closed by ``<｜tool▁calls▁end｜>`` (R1 and V3.1 spellings)."""

    close = DS_CALLS_END

    def __init__(self, opener: str, tools: ToolSpec | None) -> None:
        super().__init__(opener, tools, DS_SEP, close=DS_CALLS_END, call_end=DS_CALL_END)
        self.state = "call"

    def _step(self, final: bool) -> bool:
        buf = self.buf
        if self.state == "call":
            j = _skip_ws(buf, self.i)
            hit = _partial(buf, j, DS_CALL_BEGIN)
            if hit is None:
                return False if not final else self._fail()
            if not hit:
                self.i = j
                return self._end_marker(final) if self.calls else self._fail()
            return self._to(j + len(DS_CALL_BEGIN), "ds_name")
        if self.state == "ds_name":
            # R1: "function<sep>NAME\n```json\n{..}\n```"; V3.1: "NAME<sep>{..}"
            j = buf.find(DS_SEP, self.i)
            if j < 0:
                return False if not final else self._fail()
            head = buf[self.i : j].strip()
            if head == "function":
                k = buf.find("\n", j)
                if k < 0:
                    return False
                name = buf[j + len(DS_SEP) : k].strip()
                start = k + 1
                fence = _skip_ws(buf, start)
                if fence >= len(buf) or _partial(buf, fence, "```") is None:
                    return False
                if buf.startswith("```", fence):
                    nl = buf.find("\n", fence)
                    if nl < 0:
                        return False
                    start = nl + 1
                self.i = start
            else:
                name, self.i = head, j + len(DS_SEP)
            if not name:
                return self._fail()
            self._name(name)
            self.state = "args_start"
            return True
        if self.state == "after":
            j = _skip_ws(buf, self.i)
            if buf.startswith("```", j):
                self.i = j + 3
            elif _partial(buf, j, "```") is None and not final:
                return False
        return super()._step(final)

    def _next_call(self, final: bool) -> bool:
        self.state = "call"
        return True


class XmlCalls(Section):
    """Qwen3-Coder's ``<function=NAME><parameter=KEY>VALUE</parameter>..</function>`` in a ``<tool_call>``, and
    GLM's ``NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>..``. String parameters (by the tool's schema)
    stream as they are written; other values are read as JSON when complete (kept a string if they are not)."""

    def __init__(self, opener: str, tools: ToolSpec | None, close: str, *, glm: bool) -> None:
        super().__init__(opener, tools)
        self.close = close
        self.glm = glm
        self.key_open, self.key_close = ("<arg_key>", "</arg_key>") if glm else ("<parameter=", ">")
        self.value_open, self.value_close = ("<arg_value>", "</arg_value>") if glm else ("", "</parameter>")
        self.call_close = close if glm else "</function>"
        self.state = "function"
        self.name = ""
        self.key = ""
        self.streaming = False
        self.vstart = 0
        self.sent = 0

    def _step(self, final: bool) -> bool:
        buf = self.buf
        if self.state == "function":
            j = _skip_ws(buf, self.i)
            if self.glm:
                k = min(
                    (x for x in (buf.find("<arg_key>", j), buf.find(self.call_close, j), buf.find("\n", j)) if x >= 0),
                    default=-1,
                )
                if k < 0:
                    return False if not final else self._fail()
                name = buf[j:k].strip()
                self.i = k
            else:
                hit = _partial(buf, j, "<function=")
                if hit is None:
                    return False
                if not hit:
                    self.i = j
                    return self._end_marker(final) if self.calls else self._fail()
                k = buf.find(">", j)
                if k < 0:
                    return False
                name = buf[j + len("<function=") : k].strip()
                self.i = k + 1
            if not _NAME.fullmatch(name) or (self.glm and self.tools is not None and name not in self.tools.params):
                return self._fail()  # GLM's bare name is taken only when it names a tool: else it is text
            self.name = name
            self._name(name)
            self.state = "param"
            return True
        if self.state == "param":
            j = _skip_ws(buf, self.i)
            if _partial(buf, j, self.call_close) is True:
                self._end_args()
                self.i = j + len(self.call_close)
                self.state = "function"
                if self.glm:
                    self.done = True
                return True
            hit = _partial(buf, j, self.key_open)
            if hit is None or (hit is False and _partial(buf, j, self.call_close) is None):
                return False if not final else self._close_call()
            if not hit:
                return self._close_call()
            k = buf.find(self.key_close, j + len(self.key_open))
            if k < 0:
                return False if not final else self._close_call()
            self.key = buf[j + len(self.key_open) : k].strip()
            return self._to(k + len(self.key_close), "value_open")
        if self.state == "value_open":
            j = self.i
            if self.value_open:
                j = _skip_ws(buf, j)
                hit = _partial(buf, j, self.value_open)
                if hit is None:
                    return False
                if not hit:
                    return self._close_call()
                j += len(self.value_open)
            if j < len(buf) and buf[j] == "\n":
                j += 1  # the value's own line: the newline framing it is not part of it
            elif j >= len(buf):
                return False
            kind = self._param_type(self.name, self.key)
            self.streaming = kind == "string"
            if self.streaming:
                self._arg(self.key, '"')
            self.vstart = self.sent = j
            return self._to(j, "value")
        if self.state == "value":
            enders = (self.value_close, self.key_open, self.call_close)
            hits = [k for k in (buf.find(e, self.vstart) for e in enders) if k >= 0]
            end = min(hits) if hits else -1
            if end < 0:
                if final:
                    end = len(buf)
                else:
                    if self.streaming:
                        hold = _hold_partial(buf, self.sent, len(buf), tuple("\n" + e for e in enders) + enders)
                        self._args(json.dumps(buf[self.sent : hold], ensure_ascii=False)[1:-1])
                        self.sent = max(self.sent, hold)
                    return False
            value_end = end - 1 if end > self.vstart and buf[end - 1] == "\n" else end
            if self.streaming:
                self._args(json.dumps(buf[self.sent : value_end], ensure_ascii=False)[1:-1] + '"')
            else:
                self._arg(self.key, _json_value(buf[self.vstart : value_end]))
            return self._to(end + len(self.value_close) if buf.startswith(self.value_close, end) else end, "param")
        return False

    def _close_call(self) -> bool:
        self._end_args()
        self.state = "function"
        self.done = True
        return False

    def _finish(self) -> None:
        if self.state == "value":
            self._step(True)
        if self.state == "param":
            self._end_args()


def _json_value(text: str) -> str:
    """A parameter's text as JSON: itself when it parses, else a string."""
    stripped = text.strip()
    try:
        return json.dumps(json.loads(stripped), ensure_ascii=False)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)


class _Sniffing(Section):
    """A section whose first characters tell which parser reads it (:meth:`_choose`); that parser then reads it."""

    def __init__(self, opener: str, tools: ToolSpec | None) -> None:
        super().__init__(opener, tools)
        self.inner: Section | None = None

    def _choose(self, head: str, final: bool) -> Section | None:
        """The parser for a body starting ``head`` (None: too little text to tell yet)."""
        raise NotImplementedError

    def _settle(self, final: bool) -> None:
        """The inner section ended: take over where it stopped."""
        assert self.inner is not None
        self.buf, self.i = self.inner.buf, self.inner.i

    def feed(self, text: str, *, final: bool = False) -> list[Event]:
        if self.inner is None:
            self.buf += text
            j = _skip_ws(self.buf, 0)
            if j >= len(self.buf) and not final:
                return []
            self.inner = self._choose(self.buf[j:], final)
            if self.inner is None:
                return []
            text, self.buf = self.buf, ""
        out = self.inner.feed(text, final=final)
        self.done, self.failed = self.inner.done, self.inner.failed
        if self.done:
            self._settle(final)
        return out

    @property
    def raw(self) -> str:
        return self.opener + (self.inner.buf if self.inner is not None else self.buf)

    def _step(self, final: bool) -> bool:  # pragma: no cover - feed is overridden
        return False


class TaggedCalls(_Sniffing):
    """What follows ``<tool_call>``: JSON (Hermes), ``<function=`` (Qwen3-Coder) or a bare name (GLM), told apart
    by its first characters, so a model that writes another family's body inside the tags still works."""

    close = "</tool_call>"

    def _choose(self, head: str, final: bool) -> Section | None:
        if head[:1] in ("{", "["):
            return JsonCalls(self.opener, self.tools, self.close)
        if head.startswith("<function="):
            return XmlCalls(self.opener, self.tools, self.close, glm=False)
        if "<function=".startswith(head) and not final:
            return None
        return XmlCalls(self.opener, self.tools, self.close, glm=True)

    def _settle(self, final: bool) -> None:
        inner = self.inner
        assert inner is not None
        if inner.failed or not isinstance(inner, XmlCalls) or inner.glm:
            super()._settle(final)
            return
        rest = inner.rest  # Qwen3-Coder closes the function, then the tag
        j = _skip_ws(rest, 0)
        if rest[j:].startswith(self.close):
            rest = rest[j + len(self.close) :]
        elif self.close.startswith(rest[j:]) and not final:
            self.done = False  # the tag may still come
            return
        self.buf, self.i = rest, 0


class PythonCalls(Section):
    """LFM2's ``[name(key="v", n=1), other()]``: each keyword argument is read as a Python literal and written out
    as JSON as soon as it is complete."""

    close = "<|tool_call_end|>"
    initial = "start"

    def _step(self, final: bool) -> bool:
        buf = self.buf
        j = _skip_ws(buf, self.i)
        if j >= len(buf):
            return False
        if self.state == "start":
            return self._to(j + 1 if buf[j] == "[" else j, "call")
        if self.state == "call":
            if buf[j] in ",":
                return self._to(j + 1)
            if buf[j] == "]":
                self.i = j + 1
                return self._end_marker(final)
            m = re.compile(r"[A-Za-z_][\w.\-]*").match(buf, j)
            if m is None:
                return self._fail() if not self.calls else self._end_marker(final)
            k = _skip_ws(buf, m.end())
            if k >= len(buf):
                return False
            if buf[k] != "(":
                return self._fail()
            self._name(m.group(0))
            return self._to(k + 1, "arg")
        # arg: key=value, or ")" ends the call
        if buf[j] == ")":
            self._end_args()
            return self._to(j + 1, "call")
        if buf[j] == ",":
            return self._to(j + 1)
        m = re.compile(r"([A-Za-z_]\w*)\s*=\s*").match(buf, j)
        if m is None:
            return False if re.fullmatch(r"[A-Za-z_]\w*\s*", buf[j:]) else self._broken()
        end = _py_value_end(buf, m.end())
        if end is None:
            return False
        try:
            value = ast.literal_eval(buf[m.end() : end].strip())
            piece = json.dumps(value, ensure_ascii=False)
        except (ValueError, SyntaxError, TypeError):
            piece = json.dumps(buf[m.end() : end].strip(), ensure_ascii=False)
        self._arg(m.group(1), piece)
        return self._to(end)

    def _broken(self) -> bool:
        self._end_args()
        self.done = True
        return False

    def _finish(self) -> None:
        if self.state == "arg":
            self._end_args()


class GemmaCalls(Section):
    """Gemma 4's ``call:NAME{key:<|"|>text<|"|>,n:1,flag:true}``: keys bare, strings quoted by ``<|"|>``, the rest
    JSON-like; each argument goes out as JSON once complete."""

    close = "<tool_call|>"
    initial = "call"

    def _step(self, final: bool) -> bool:
        buf = self.buf
        j = _skip_ws(buf, self.i)
        if j >= len(buf):
            return False
        if self.state == "end":
            return self._end_marker(final)
        if self.state == "call":
            hit = _partial(buf, j, "call:")
            if hit is None:
                return False
            if not hit:
                return self._fail()
            k = buf.find("{", j)
            if k < 0:
                return False
            name = buf[j + len("call:") : k].strip()
            if not name:
                return self._fail()
            self._name(name)
            return self._to(k + 1, "arg")
        if buf[j] == "}":
            self._end_args()
            return self._to(j + 1, "end")
        if buf[j] == ",":
            return self._to(j + 1)
        k = buf.find(":", j)
        if k < 0:
            return False
        key = buf[j:k].strip()
        end = _gemma_value_end(buf, k + 1)
        if end is None:
            return False
        piece = _gemma_value(buf[k + 1 : end])
        self._arg(key, piece)
        return self._to(end)

    def _finish(self) -> None:
        if self.state == "arg":
            self._end_args()


def _gemma_value_end(buf: str, i: int) -> int | None:
    depth, n = 0, len(buf)
    while i < n:
        if buf.startswith(GEMMA_QUOTE, i):
            k = buf.find(GEMMA_QUOTE, i + len(GEMMA_QUOTE))
            if k < 0:
                return None
            i = k + len(GEMMA_QUOTE)
            continue
        c = buf[i]
        if c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                return i
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    return None


def _gemma_value(text: str) -> str:
    """A Gemma value as JSON: ``<|"|>``-quoted strings become JSON strings, bare keys in objects are quoted."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith(GEMMA_QUOTE, i):
            k = text.find(GEMMA_QUOTE, i + len(GEMMA_QUOTE))
            out.append(json.dumps(text[i + len(GEMMA_QUOTE) : k], ensure_ascii=False))
            i = k + len(GEMMA_QUOTE)
            continue
        m = re.compile(r"([A-Za-z_]\w*)\s*:").match(text, i)
        if m is not None and (not out or out[-1].rstrip().endswith(("{", ","))):
            out.append(json.dumps(m.group(1)) + ":")
            i = m.end()
            continue
        out.append(text[i])
        i += 1
    return _json_value("".join(out))


def section_for(fmt: ChatFormat, opener: str, tools: ToolSpec | None) -> Section:
    """The parser of the section ``opener`` starts in format ``fmt``."""
    if opener == "<tool_call>":
        return TaggedCalls(opener, tools)
    if opener == "<|tool_call|>":
        return JsonCalls(opener, tools, "<|/tool_call|>")
    if opener == "<|python_tag|>":
        return JsonCalls(opener, tools)
    if opener == "[TOOL_CALLS]":
        return _MistralCalls(opener, tools)
    if opener == "<|tool_call_start|>":
        return PythonCalls(opener, tools)
    if opener == DS_CALLS_BEGIN:
        return DeepSeekCalls(opener, tools)
    if opener == "<|tool_call>":
        return GemmaCalls(opener, tools)
    raise ValueError(f"no section parser for {opener!r}")  # pragma: no cover - FORMATS and this table agree


class _MistralCalls(_Sniffing):
    """``[TOOL_CALLS]`` then a JSON list (Mistral Nemo, Small 3.1) or ``NAME[ARGS]{..}`` (Devstral, Small 3.2,
    Magistral), told apart by the first character."""

    def _choose(self, head: str, final: bool) -> Section | None:
        if head[:1] in ("[", "{"):
            return JsonCalls(self.opener, self.tools)
        return NamedJson(self.opener, self.tools, "[ARGS]")


# ----------------------------------------------------------------------------- harmony (gpt-oss)

_H_START, _H_MESSAGE, _H_END, _H_CALL, _H_RETURN = "<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
_H_ENDS = (_H_END, _H_CALL, _H_RETURN, _H_START)
_H_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_H_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    """gpt-oss's output as channels: ``<|channel|>analysis<|message|>..<|end|>`` is reasoning, ``final`` (and a
    ``commentary`` preamble) is content, and a message ``to=functions.NAME`` is a call whose body is its JSON
    arguments, streamed as written (content when the request has no tools). Markup the model leaves out (a reply
    without any header) is content."""

    def __init__(self, *, tools: ToolSpec | None = None) -> None:
        self.tools = tools
        self.buf = ""
        self.state = "header"
        self.kind = "content"
        self.sent = 0

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self.state == "body":
            self._emit(self.buf[self.sent :], out)
        elif self.state == "header" and self.buf.strip() and _H_MESSAGE not in self.buf:
            if not self.buf.lstrip().startswith(("<|channel|>", _H_START)):
                out.append(("content", self.buf))
        self.buf = ""
        return out

    def _emit(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        kind = "tool_args" if self.kind == "tool" else self.kind
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _step(self, out: list[Event], *, final: bool) -> bool:
        buf = self.buf
        if self.state == "header":
            stripped = buf.lstrip()
            if stripped and not stripped.startswith(("<", _H_START[: len(stripped)])):
                self.state, self.kind, self.sent = "body", "content", 0  # no header at all: plain text
                return True
            j = buf.find(_H_MESSAGE)
            if j < 0:
                return False
            header = buf[:j]
            channel = _H_CHANNEL.search(header)
            recipient = _H_RECIPIENT.search(header)
            if self.tools is not None and recipient is not None and recipient.group(1).startswith("functions."):
                self.kind = "tool"
                out.append(("tool_name", recipient.group(1)[len("functions.") :]))
            elif channel is not None and channel.group(1) == "analysis":
                self.kind = "reasoning"
            else:
                self.kind = "content"
            self.buf = buf[j + len(_H_MESSAGE) :]
            self.sent = 0
            self.state = "body"
            return True
        # body: up to the message's end marker
        hits = [k for k in (buf.find(e, self.sent) for e in _H_ENDS) if k >= 0]
        if not hits:
            hold = len(buf) if final else _hold_partial(buf, self.sent, len(buf), _H_ENDS)
            self._emit(buf[self.sent : hold], out)
            self.sent = hold
            return False
        end = min(hits)
        self._emit(buf[self.sent : end], out)
        k = end
        for e in _H_ENDS:
            if buf.startswith(e, end):
                k = end + (len(e) if e != _H_START else 0)
                break
        self.buf = buf[k:]
        self.sent = 0
        self.state = "header"
        return True
