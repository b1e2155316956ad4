"""Streaming splitters: generated text to ``content`` / ``reasoning_content`` / ``tool_calls`` events, and stop strings.

The classes work on the text *delta* of each token and keep at most a tag's length of text held back, so the
per-token cost does not grow with the length of the answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from lemonkit.backends.chat.messages import THINK_CLOSE, THINK_OPEN, TOOL_CLOSE, TOOL_OPEN
from lemonkit.backends.chat.tools import parse_json_calls, tool_call_from_obj

__all__ = ["Event", "ForcedToolStream", "StopMatcher", "StreamParser", "split_output"]

#: A parse event: ("content" | "reasoning", text) or ("tool_call", {"name": str, "arguments": str}).
Event = tuple[str, Any]

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
        calls = parse_json_calls(body, None)
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
            calls = parse_json_calls(buf, None)  # a call cut off before </tool_call>
            if calls is None:
                self._emit("content", TOOL_OPEN + buf, out)
            else:
                out.extend(("tool_call", c) for c in calls)
        elif self._mode == "json":
            calls = parse_json_calls(buf, self._names)
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
        call = tool_call_from_obj(obj, None)
        if self._name is not None:
            tail = self._buf[self._args_start :].rstrip()
            tail = tail[:-1].rstrip() if call is not None and tail.endswith("}") else tail
            if len(tail) > self._sent:
                out.append(("tool_args", tail[self._sent :]))
                self._sent = len(tail)
        return out, call
