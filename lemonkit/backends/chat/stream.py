"""Streaming splitters: generated text to ``content`` / ``reasoning_content`` / ``tool_calls`` events, and stop strings.

The classes work on the text *delta* of each token and keep at most a tag's length of text held back, so the
per-token cost does not grow with the length of the answer.
"""

from __future__ import annotations

import json
import re

from lemonkit.backends.chat.messages import THINK_CLOSE, THINK_OPEN, TOOL_OPEN
from lemonkit.backends.chat.tool_formats import (
    FORMATS,
    ChatFormat,
    Event,
    HarmonyParser,
    JsonCalls,
    Section,
    section_for,
)
from lemonkit.backends.chat.tools import ToolSpec, tool_call_from_obj

__all__ = ["Event", "ForcedToolStream", "StopMatcher", "StreamParser", "make_parser", "split_output"]


def _partial_tag_start(text: str, tags: tuple[str, ...]) -> int:
    """Index where a suffix of ``text`` that could start one of ``tags`` begins, else len(text).

    Only the last ``max(len(tag)) - 1`` characters are looked at: cost is independent of ``text``.
    """
    n = len(text)
    longest = max(len(t) for t in tags)
    firsts = {t[0] for t in tags}
    for i in range(max(0, n - longest + 1), n):
        if text[i] in firsts:
            tail = text[i:]
            if any(t.startswith(tail) for t in tags):
                return i
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
        #: the stop string that ended the text, once one has
        self.matched: str | None = None

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
                cut, self.matched = j, s
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
    """Splits generated text into reasoning, content and tool calls as it streams, in the markup of ``fmt``.

    The format's reasoning tags go to reasoning (also when the prompt opened them, see ``in_reasoning``). With
    ``tools`` (tool_choice ``auto``) the format's tool-call sections (and Hermes ``<tool_call>`` tags, which the
    fallback tool prompt teaches) become ``tool_name`` / ``tool_args`` events as they are written, and so does a
    reply that opens with a JSON object naming one of the tools. Text that might be the start of a marker is held
    back until it is decided.
    """

    def __init__(
        self, *, in_reasoning: bool = False, tools: ToolSpec | None = None, fmt: ChatFormat | None = None
    ) -> None:
        fmt = fmt or FORMATS["hermes"]
        self._fmt = fmt
        self._tools = tools
        self._mode = "reasoning" if in_reasoning else "content"
        self._think_open, self._think_close = fmt.think or (THINK_OPEN, THINK_CLOSE)
        openers = tuple(dict.fromkeys((*fmt.openers, TOOL_OPEN))) if tools is not None else ()
        self._openers = openers
        self._tags: tuple[str, ...] = (self._think_open, *openers)
        self._first = "".join({t[0] for t in self._tags})
        self._section: Section | None = None
        self._buf = ""
        self._any_content = False
        self._json_checked = tools is None  # the answer's start was checked for a bare JSON tool call
        # Whitespace between a tag and the text it frames is formatting, not output (as llama-server).
        self._strip_content = False
        self._strip_reasoning = in_reasoning

    def _emit(self, kind: str, text: str, out: list[Event]) -> None:
        if self._strip_content if kind == "content" else self._strip_reasoning:
            text = text.lstrip()
        if not text:
            return
        if kind == "content":
            self._strip_content = False
            self._any_content = True
        else:
            self._strip_reasoning = False
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _has_marker_char(self, text: str) -> bool:
        return any(c in text for c in self._first)

    def _hold(self, buf: str) -> int:
        """Where a suffix of ``buf`` that could start a tag begins (the whitespace before it held too, with tools)."""
        k = _partial_tag_start(buf, self._tags)
        if self._tools is not None:
            while k > 0 and buf[k - 1] in " \t\r\n":
                k -= 1
        return k

    def feed(self, text: str) -> list[Event]:
        """Events decided by this delta (often one; empty while text is held back)."""
        if not self._buf and self._mode == "content" and self._json_checked and not self._strip_content:
            # the common case, kept cheap: plain answer text (trailing whitespace may precede a call: held)
            if not self._has_marker_char(text) and (self._tools is None or not text[-1:].isspace()):
                if text:
                    self._any_content = True
                    return [("content", text)]
                return []
        out: list[Event] = []
        self._buf += text
        self._run(out, final=False)
        return out

    def _run(self, out: list[Event], *, final: bool) -> None:
        while self._buf or (final and self._section is not None):
            buf = self._buf
            if self._mode == "section":
                section = self._section
                assert section is not None
                self._buf = ""
                out.extend(section.feed(buf, final=final))
                if not section.done:
                    return
                self._section = None
                self._mode = "content"
                if section.failed:
                    self._emit("content", section.opener, out)
                    self._buf = section.raw[len(section.opener) :]
                    continue
                self._buf = section.rest
                self._strip_content = True
                continue
            if self._mode == "reasoning":
                j = buf.find(self._think_close)
                if j >= 0:
                    self._emit("reasoning", buf[:j].rstrip(), out)
                    self._buf = buf[j + len(self._think_close) :]
                    self._mode = "content"
                    self._strip_content = True
                    continue
                # Hold back a partial tag, and whitespace that may turn out to precede the tag.
                k = len(buf) if final else _trailing_hold(buf, (self._think_close,))
                self._emit("reasoning", buf[:k], out)
                self._buf = buf[k:]
                return
            # content
            if not self._json_checked and not self._any_content:
                stripped = buf.lstrip()
                if not stripped:
                    if final:
                        self._buf = ""
                    return
                self._json_checked = True
                if stripped[0] == "{":
                    self._section = JsonCalls("", self._tools, bare=True)
                    self._mode = "section"
                    continue
            if not self._has_marker_char(buf):  # fast path: no tag can start here
                k = len(buf) if final or self._tools is None else self._hold(buf)
                self._emit("content", buf[:k], out)
                self._buf = buf[k:]
                return
            hits = [(j, t) for j, t in ((buf.find(t), t) for t in self._tags) if j >= 0]
            if hits:
                j, tag = min(hits)
                if tag == self._think_open:
                    self._emit("content", buf[:j], out)
                    self._mode = "reasoning"
                    self._strip_reasoning = True
                else:
                    self._emit("content", buf[:j].rstrip(), out)
                    self._section = section_for(self._fmt, tag, self._tools)
                    self._mode = "section"
                self._buf = buf[j + len(tag) :]
                continue
            k = len(buf) if final else self._hold(buf)
            self._emit("content", buf[:k], out)
            self._buf = buf[k:]
            return

    def finish(self) -> list[Event]:
        """Flush what was held back at the end of generation."""
        out: list[Event] = []
        self._run(out, final=True)
        if self._buf:  # reasoning cut off, or held text
            self._emit("reasoning" if self._mode == "reasoning" else "content", self._buf, out)
            self._buf = ""
        return out


def make_parser(
    fmt: ChatFormat | None, *, in_reasoning: bool = False, tools: ToolSpec | None = None
) -> StreamParser | HarmonyParser:
    """The streaming parser of format ``fmt`` (Hermes when None)."""
    if fmt is not None and fmt.name == "harmony":
        return HarmonyParser(tools=tools)
    return StreamParser(in_reasoning=in_reasoning, tools=tools, fmt=fmt)


def split_output(
    text: str, *, in_reasoning: bool = False, tools: ToolSpec | None = None, fmt: ChatFormat | None = None
) -> list[Event]:
    """The events of a whole answer, merged by kind, each call assembled: ``("tool_call", {"name", "arguments"})``."""
    parser = make_parser(fmt, in_reasoning=in_reasoning, tools=tools)
    merged: list[Event] = []
    for kind, value in parser.feed(text) + parser.finish():
        if kind == "tool_name":
            merged.append(("tool_call", {"name": value, "arguments": ""}))
        elif kind == "tool_args":
            merged[-1][1]["arguments"] += value
        elif merged and merged[-1][0] == kind:
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
        call = tool_call_from_obj(obj, None)
        if self._name is not None:
            tail = self._buf[self._args_start :].rstrip()
            tail = tail[:-1].rstrip() if call is not None and tail.endswith("}") else tail
            if len(tail) > self._sent:
                out.append(("tool_args", tail[self._sent :]))
                self._sent = len(tail)
        return out, call
